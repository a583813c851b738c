# dreamer for a GPU node, and for the CPU nodes of a Ray cluster (README, "Env workers on a Ray cluster"):
# CUDA, JDK 8, MineRL 0.4.4 (a prebuilt wheel), Ray.
#
# Build, from the repository root (needs the network):
#   docker build -t dreamer .
# Train on MineRL's diamond task (all GPUs; shared memory for 64 env workers; run folders kept on the host):
#   docker run --rm --gpus all --shm-size=32g -v "$PWD/runs:/app/runs" dreamer
# Any other command or override, for instance a named run that logs to wandb:
#   docker run --rm --gpus all --shm-size=32g -v "$PWD/runs:/app/runs" -e WANDB_API_KEY \
#       dreamer python -m dreamer.train +exp=minecraft logger=wandb run.name=diamond-s1 seed=1
# Rerunning the same command resumes the run from its newest checkpoint in runs/<run.name>.

FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MUJOCO_GL=egl \
    PATH=/opt/venv/bin:$PATH

# Python 3.11, JDK 8 for Minecraft, a virtual X server for its window, EGL and ffmpeg for videos.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3.11 python3.11-venv python3.11-dev build-essential git ca-certificates \
        openjdk-8-jdk xvfb libgl1 libegl1 libglu1-mesa ffmpeg \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv

# torch first, then MineRL: these layers stay cached when the project changes.
RUN pip install torch==2.13.0
# MineRL 0.4.4 as a prebuilt wheel (distribution minerl_mirror, package minerl), the one the reference's own
# image installs: `pip install minerl==0.4.4` builds Minecraft with Gradle, and that build fails today (the
# MixinGradle and ForgeGradle artifacts its build.gradle fetches from jitpack are gone; minerllabs/minerl
# issues 744 and 790). Python 3.11 only. It runs on gym 0.19, whose metadata only older pip and setuptools
# accept. The URL and hash are the `minecraft` extra's in pyproject.toml.
RUN pip install pip==24.0 setuptools==65.5.0 wheel==0.38.4 \
    && pip install gym==0.19.0 \
    && pip install "minerl_mirror @ https://github.com/danijar/minerl/releases/download/v0.4.4-patched/minerl_mirror-0.4.4-cp311-cp311-linux_x86_64.whl#sha256=b04e2cd21627e835d5b1566db1fe69ed1bff8abed1c804340ebd61c78a1dc631"

WORKDIR /app
# The project's dependencies (from pyproject.toml alone, where every version is pinned), then the source.
COPY pyproject.toml README.md ./
# hadolint ignore=DL3013
RUN mkdir dreamer && touch dreamer/__init__.py \
    && pip install ".[minecraft,dmc,media,ray]" \
    && rm -rf dreamer build ./*.egg-info
COPY dreamer ./dreamer
COPY configs ./configs
COPY scripts ./scripts
RUN pip install --no-deps -e .

ENTRYPOINT ["xvfb-run", "--auto-servernum", "--server-args=-screen 0 1024x768x24"]
CMD ["python", "-m", "dreamer.train", "+exp=minecraft"]
