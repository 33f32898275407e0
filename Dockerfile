# The project's image: the operator, the frontend and the trainer-side sidecar are all `drs`
# subcommands of this one Python package (the engine has its own image, engine_image/Dockerfile,
# because it needs TensorRT-LLM).
#
#   docker build -t ghcr.io/disagg-dev/drs:0.1.0 .
#   docker run --rm ghcr.io/disagg-dev/drs:0.1.0 operator --help
#
# The Helm chart (helm/drs-operator) runs it as `drs operator`; DisaggReplicaSets name it in
# spec.images.frontend. Two stages: the first builds a virtualenv from the source tree, the second
# holds only that virtualenv on the same pinned base. No development or test dependencies.
#
# With no registry (this repository's dev machines), `drs dev images` builds it on a local Debian
# base (BASE_IMAGE=drs-base:bookworm, made with mmdebstrap) and passes the host's CA bundle as the
# BuildKit secret `ca-bundle`, for pip behind a TLS-inspecting proxy; the secret is mounted for
# the pip steps only and is in no layer. Both are optional for a plain `docker build`.
#
# Rebuilds are fast: the dependencies are installed from pyproject.toml's list before any source
# (or the README) is copied, so a source change reuses that layer; pip's downloads live in a
# BuildKit cache mount, so a dependency change downloads only what changed. Neither cache is in
# the image.
ARG BASE_IMAGE=python:3.11.14-slim-bookworm
FROM ${BASE_IMAGE} AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml ./
RUN --mount=type=secret,id=ca-bundle,required=false \
    --mount=type=cache,target=/root/.cache/pip,sharing=locked \
    if test -s /run/secrets/ca-bundle; then export PIP_CERT=/run/secrets/ca-bundle; fi \
    && python -m venv /opt/drs \
    && python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
       > /tmp/requirements.txt \
    && /opt/drs/bin/python -m pip install -r /tmp/requirements.txt
COPY README.md ./
COPY cli/ cli/
COPY operator/ operator/
COPY frontend/ frontend/
COPY engine_image/drs_engine/ engine_image/drs_engine/
COPY protocol/ protocol/
COPY devcluster/ devcluster/
COPY sidecar/ sidecar/
COPY client/ client/
RUN --mount=type=secret,id=ca-bundle,required=false \
    --mount=type=cache,target=/root/.cache/pip,sharing=locked \
    if test -s /run/secrets/ca-bundle; then export PIP_CERT=/run/secrets/ca-bundle; fi \
    && /opt/drs/bin/python -m pip install --no-deps .

# The `gym` target (`docker build --target gym -t drs-gym:0.1.0 .`): NeMo-Gym 0.7.0, the real
# client `make demo` and tests/realnodes run in a pod (examples/gym_agent.py: Gym's own vllm_model
# server in front of the fleet's status URLs, and an agent loop through it), in a venv of its own,
# /opt/gym, with exactly the pins of .venv-gym (tests/realgym/requirements.txt + constraints.txt).
# NeMo-Gym declares Python >= 3.13.14; its vllm_model server runs on this 3.11 (tests/realgym runs it
# so), hence --ignore-requires-python, as the Makefile's gym-install does; wheels only, except
# antlr4-python3-runtime 4.9.3 (hydra's parser, pure Python), which exists only as an sdist.
# Its layers depend on those two files and this Dockerfile only: a source change rebuilds nothing.
FROM ${BASE_IMAGE} AS gym-build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1

COPY tests/realgym/requirements.txt tests/realgym/constraints.txt /tmp/gym/
RUN --mount=type=secret,id=ca-bundle,required=false \
    --mount=type=cache,target=/root/.cache/pip,sharing=locked \
    if test -s /run/secrets/ca-bundle; then export PIP_CERT=/run/secrets/ca-bundle; fi \
    && python -m venv /opt/gym \
    && /opt/gym/bin/python -m pip install --ignore-requires-python --only-binary=:all: \
       --no-binary=antlr4-python3-runtime -r /tmp/gym/requirements.txt -c /tmp/gym/constraints.txt

FROM ${BASE_IMAGE} AS gym

LABEL org.opencontainers.image.title="drs-gym" \
      org.opencontainers.image.description="NeMo-Gym 0.7.0 (its vllm_model server) for the drs demo's rollout pod" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PATH=/opt/gym/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1

RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin drs
COPY --from=gym-build /opt/gym /opt/gym

USER 10001:10001
WORKDIR /home/drs
CMD ["python", "-c", "import nemo_gym, responses_api_models.vllm_model; print('NeMo-Gym', nemo_gym.__version__)"]

# The default target: the project's image.
FROM ${BASE_IMAGE}

LABEL org.opencontainers.image.title="drs" \
      org.opencontainers.image.description="DisaggReplicaSet operator, frontend and sidecar" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PATH=/opt/drs/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1

RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin drs
COPY --from=build /opt/drs /opt/drs

USER 10001:10001
WORKDIR /home/drs
# 8080 operator /healthz, 9090 operator /metrics; frontends listen on their spec.frontend ports.
EXPOSE 8080 9090
ENTRYPOINT ["drs"]
CMD ["--help"]
