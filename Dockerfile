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
