#!/usr/bin/env bash
# Builds the code interpreter's template image (docs/e2b.md "Code interpreter") as an OCI
# layout tagged `v1`: a minimal Debian with python3 (scripts/build-base-image.sh's recipe),
# a virtual environment /opt/code-interpreter/venv with jupyter_client, ipykernel and the
# libraries code usually wants (numpy, pandas, matplotlib), bash_kernel for Bash, and our server
# (packaging/code-interpreter/server.py) with its IPython startup files. Packages come from
# PyPI through the host's pip settings while the image is built; a sandbox of the image
# needs no network.
#
#   bash packaging/code-interpreter/build.sh OUT_LAYOUT
#   opendsec ctl image import ./OUT_LAYOUT#v1 -as root/code-interpreter:v1
#
# `cluster up` offers the image as E2B's template `code-interpreter-v1` (its start command
# runs the server, which listens on 127.0.0.1:49999). Needs root, debootstrap and umoci;
# about three minutes and 600 MB. OPENDSEC_CI_PACKAGES replaces the package list (pins
# welcome); OPENDSEC_DEBIAN_MIRROR and OPENDSEC_DEBIAN_SUITE as for build-base-image.sh.
set -euo pipefail
out=${1:?usage: build.sh OUT_LAYOUT}
here=$(cd "$(dirname "$0")" && pwd)
packages=${OPENDSEC_CI_PACKAGES:-"jupyter_client ipykernel bash_kernel numpy pandas matplotlib"}

work=$(mktemp -d)
# The image's /proc is mounted while pip runs: never remove anything under a mounted one.
trap 'if umount "$work/bundle/rootfs/proc" 2>/dev/null || ! mountpoint -q "$work/bundle/rootfs/proc" 2>/dev/null; then rm -rf "$work"; fi' EXIT
# The base image's root file system, unpacked from its layout (built once, kept beside).
base=${OPENDSEC_CI_BASE:-$(dirname "$out")/code-interpreter-base}
if [ ! -f "$base/index.json" ]; then
  OPENDSEC_EXTRA_PACKAGES=python3-venv bash "$here/../../scripts/build-base-image.sh" "$base"
fi
umoci unpack --image "$base:python3" "$work/bundle" >/dev/null
rootfs=$work/bundle/rootfs

# pip inside the image's root, for the build only, with the host's name resolution, its
# package index settings and the certificates it trusts (a machine whose HTTPS goes through
# an inspecting proxy trusts that proxy's authority; the image does not).
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
host_ca=""
for f in "${PIP_CERT:-}" "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt; do
  if [ -n "$f" ] && [ -f "$f" ]; then host_ca=$f; break; fi
done
[ -n "$host_ca" ] && cp "$host_ca" "$rootfs/tmp/host-ca.pem"
mount -t proc proc "$rootfs/proc"
echo "code-interpreter: pip install $packages (a few minutes)" >&2
env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
  ${host_ca:+PIP_CERT=/tmp/host-ca.pem} \
  ${PIP_INDEX_URL:+PIP_INDEX_URL=$PIP_INDEX_URL} ${PIP_EXTRA_INDEX_URL:+PIP_EXTRA_INDEX_URL=$PIP_EXTRA_INDEX_URL} \
  ${PIP_TRUSTED_HOST:+PIP_TRUSTED_HOST=$PIP_TRUSTED_HOST} ${PIP_DEFAULT_TIMEOUT:+PIP_DEFAULT_TIMEOUT=$PIP_DEFAULT_TIMEOUT} \
  ${https_proxy:+https_proxy=$https_proxy} ${http_proxy:+http_proxy=$http_proxy} \
  chroot "$rootfs" /bin/sh -c "python3 -m venv /opt/code-interpreter/venv \
    && /opt/code-interpreter/venv/bin/pip install -q --no-cache-dir --disable-pip-version-check $packages \
    && { ! /opt/code-interpreter/venv/bin/python -c 'import bash_kernel' 2>/dev/null \
         || /opt/code-interpreter/venv/bin/python -m bash_kernel.install --sys-prefix; }" \
  >"$work/pip.log" 2>&1 || { tail -n 30 "$work/pip.log" >&2; exit 1; }
umount "$rootfs/proc"
rm -f "$rootfs/etc/resolv.conf" "$rootfs/tmp/host-ca.pem"
install -d "$rootfs/opt/code-interpreter/ipython/profile_default/startup" "$rootfs/home/user"
install -m 0644 "$here/server.py" "$rootfs/opt/code-interpreter/server.py"
install -m 0644 "$here/startup.py" "$rootfs/opt/code-interpreter/ipython/profile_default/startup/00-opendsec.py"
rm -rf "$rootfs"/root/.cache "$rootfs"/tmp/*

rm -rf "$out.tmp"
umoci init --layout "$out.tmp"
umoci new --image "$out.tmp:v1"
umoci insert --image "$out.tmp:v1" "$rootfs" /
umoci config --image "$out.tmp:v1" --os linux --architecture amd64 \
  --config.env PATH=/opt/code-interpreter/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --config.env LANG=C.UTF-8 --config.workingdir /home/user
umoci gc --layout "$out.tmp"
rm -rf "$out"
mv "$out.tmp" "$out"
echo "code-interpreter: $out ($(du -sh "$out" | cut -f1))" >&2
