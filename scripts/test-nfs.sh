#!/usr/bin/env bash
# The image store's tests again with the store on NFS 4.2 (docs/testing.md "The image store on
# NFS"): production keeps the store on a NAS, and NFS carries no trusted.* xattrs, so whiteouts,
# opaque directories, hard links, renames and overlay over the layers must work there too. Our
# test machines' kernel has no NFS, so the server and the client both run in the guest of
# scripts/v2-guest.sh (Debian's stock kernel, with its nfsd and nfsv4 modules), on 127.0.0.1.
# Needs the release build and .venv of scripts/test.sh, and nfs-kernel-server's tools.
set -euo pipefail
cd "$(dirname "$0")/.."
export CI="${CI:-true}"
command -v rpc.nfsd >/dev/null 2>&1 || [ -x /usr/sbin/rpc.nfsd ] || {
  apt-get update -qq && apt-get install -y -qq nfs-kernel-server >/dev/null
}

# The test binaries the guest runs, by their cargo target names.
bins=$(cargo test --release --no-run --lib --test image_import --test image_unpack \
  --test container_store_images --message-format=json 2>/dev/null |
  .venv/bin/python -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["target"]["name"] + "=" + m["executable"])')
bin() { printf '%s\n' "$bins" | sed -n "s/^$1=//p" | head -1; }
lib=$(bin opendsec)
for t in "$lib" "$(bin image_import)" "$(bin image_unpack)" "$(bin container_store_images)"; do
  [ -x "$t" ] || { echo "$0: a test binary is missing (got: $bins)" >&2; exit 1; }
done

PYTHONDONTWRITEBYTECODE=1 bash scripts/v2-guest.sh -mem 6144 -timeout 1500 -modules "nfsd nfsv4" -- \
  bash scripts/nfs-store.sh bash -c "
  set -euo pipefail
  store=\$OPENDSEC_TEST_NFS_STORE
  # store-check: every required item ok; trusted.* xattrs, which NFS does not carry, only warn.
  out=\$(target/x86_64-unknown-linux-gnu/release/opendsec ctl image store-check -store \$store/check)
  echo \"\$out\"
  [ \"\$(printf '%s\n' \"\$out\" | grep -c '^ok ')\" = 12 ]
  printf '%s\n' \"\$out\" | grep -q '^warn .*trusted\.\* xattrs'
  printf '%s\n' \"\$out\" | grep -q '^ok .*holes of sparse files'
  # The store's own tests with every temporary directory on NFS: layers, manifests, gc,
  # the layer cache, the malicious tar corpus and its canary tree, local imports. Not the
  # pack tests: their fixture is a sandbox's writable layer, which carries overlay's trusted.*
  # xattrs and lives on a node's own disk, never on the store (the SDK's pack_diff test below
  # packs into the NFS store).
  mkdir -p \$store/t
  TMPDIR=\$store/t $(printf %q "$lib") --test-threads=2 images:: --skip images::pack::
  TMPDIR=\$store/t $(printf %q "$(bin image_import)") --test-threads=2
  # The two generated-tar properties test the parser, whatever the file system, and take
  # minutes under emulation: they run on the host only.
  TMPDIR=\$store/t $(printf %q "$(bin image_unpack)") --test-threads=2 \
    --skip generated_tars_stay_inside_their_layer --skip corrupted_tars_never_escape
  # Containers stacked from layers kept on NFS (the node's state stays local).
  $(printf %q "$(bin container_store_images)") --test-threads=1
  # The SDK and CLI over a cluster whose store is on NFS: import, compose, gc, pack_diff,
  # snapshots, fork, and killed writers that leave nothing half-written.
  # The restart drill writes 32 MB rather than 256: under emulation the 256 MB of random data
  # it generates, imports, writes in a sandbox and packs (twice) take longer than the guest's
  # limit. A test that hangs fails at --timeout with its stack, and the rest still run.
  cd sdk/python
  OPENDSEC_TEST_DRILL_MB=32 ../../.venv/bin/python -m pytest -p no:cacheprovider -q --durations=0 --timeout 600 \
    tests/test_images.py tests/test_containers.py \
    -k 'import_compose or store_image or pack_diff or fork_copies or sigkill_mid_write'"
echo "the image store's tests passed on NFS 4.2"
