#!/usr/bin/env bash
# Print the --build-arg flags that pin the images' base images by digest.
#
#   deploy/pin-base-image.sh                          # python:3.11-slim, vllm/vllm-openai:v0.32.0
#   deploy/pin-base-image.sh <image> [<image> ...]    # any others (e.g. vLLM's CPU image)
#
# Reads each tag's current digest (the multi-platform index) from its registry with
# `docker buildx imagetools inspect`, so it needs Docker with buildx and a network path
# to the registry. Pass the printed flags to `docker build` (deploy/README.md, "Images"),
# through a variable, so that a failure here stops the build (a failed `$(...)` inside the
# `docker build` line would not: it would build from the unpinned tags):
#
#   pins=$(deploy/pin-base-image.sh python:3.11-slim) &&
#     docker build -f deploy/Dockerfile $pins -t <registry>/nightjar-sidecar:0.1.0 .
#
# Record the digests you built with (e.g. in your CI's build log or a release note). The
# Dockerfiles pin python:3.11-slim by digest already (a recorded build: this moves it to the
# tag's current one); vLLM's image is a tag there, which this repository cannot resolve.
set -euo pipefail

if [ "$#" -eq 0 ]; then
  set -- python:3.11-slim vllm/vllm-openai:v0.32.0
fi

if ! docker buildx version >/dev/null 2>&1; then
  echo "pin-base-image.sh: needs Docker with buildx ('docker buildx version' failed): install" \
    "the buildx plugin (https://docs.docker.com/go/buildx/), or pin by hand with" \
    "--build-arg BASE_IMAGE=<image>@sha256:<digest> (deploy/README.md, \"Images\")" >&2
  exit 1
fi

for image in "$@"; do
  case "$image" in
    *@sha256:*) echo "$image is already pinned" >&2; exit 2 ;;
  esac
  if ! digest=$(docker buildx imagetools inspect "$image" --format '{{.Manifest.Digest}}'); then
    echo "pin-base-image.sh: cannot read the digest of $image from its registry (above)" >&2
    exit 1
  fi
  case "$digest" in
    sha256:*) ;;
    *) echo "no digest for $image (got: $digest)" >&2; exit 1 ;;
  esac
  case "$image" in
    python:*) arg=BASE_IMAGE ;;
    *) arg=VLLM_IMAGE ;;
  esac
  printf -- '--build-arg %s=%s@%s ' "$arg" "$image" "$digest"
done
echo
