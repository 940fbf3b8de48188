#!/usr/bin/env bash
# Regenerates unifab-nccl-tests.patch from this folder's sources (src/) and build-list changes
# (build-lists.patch), against a clean git checkout of nccl-tests at the pinned version:
#   nccl-tests-patches/make-patch.sh PATH_TO_CLEAN_NCCL_TESTS_CHECKOUT [OUTPUT]
# The checkout is left as it was.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
tree="$(cd "${1:?usage: make-patch.sh PATH_TO_CLEAN_NCCL_TESTS_CHECKOUT [OUTPUT]}" && pwd)"
output="${2:-$here/unifab-nccl-tests.patch}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
git -C "$tree" archive HEAD | tar -x -C "$work"
(cd "$work" && git init -q && git add -A && git -c user.name=unifab -c user.email=unifab@localhost commit -qm base)
(cd "$work" && git apply "$here/build-lists.patch")
cp "$here"/src/*.cu "$here"/src/*.h "$work/src/"
(cd "$work" && git add -A && git diff --cached) >"$output"
echo "wrote $output"
