# dreamer for a GPU node: CUDA, JDK 8 and MineRL 0.4.4 (Minecraft is built while the image builds).
#
# Build, from the repository root (needs the network: MineRL's install runs Gradle):
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
# MineRL 0.4.4 wants gym 0.19, whose metadata only older pip and setuptools accept.
RUN pip install pip==24.0 setuptools==65.5.0 wheel==0.38.4 \
    && pip install gym==0.19.0 minerl==0.4.4

WORKDIR /app
# The project's dependencies (from pyproject.toml alone, where every version is pinned), then the source.
COPY pyproject.toml README.md ./
# hadolint ignore=DL3013
RUN mkdir dreamer && touch dreamer/__init__.py \
    && pip install ".[minecraft,dmc,media]" \
    && rm -rf dreamer build ./*.egg-info
COPY dreamer ./dreamer
COPY configs ./configs
COPY scripts ./scripts
RUN pip install --no-deps -e .

ENTRYPOINT ["xvfb-run", "--auto-servernum", "--server-args=-screen 0 1024x768x24"]
CMD ["python", "-m", "dreamer.train", "+exp=minecraft"]
