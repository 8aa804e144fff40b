"""A sandbox's envdAccessToken (docs/e2b.md "Access tokens and signed URLs"): the sandbox's own
access token, never the caller's API key; good for the in-sandbox calls of that one sandbox
and nothing else, at the gateway and at the apiserver alike; and the signed file URLs E2B's
SDK makes with it, each good for its path, its operation and its time."""

from __future__ import annotations

import os

import httpx
import pytest
from e2b import Sandbox


@pytest.fixture(scope="module")
def pair(linux):
    a, b = Sandbox.create(), Sandbox.create()
    yield a, b
    a.kill()
    b.kill()


def files_url() -> str:
    return f"{os.environ['E2B_SANDBOX_URL']}/files"


def test_the_envd_access_token_is_the_sandbox_s_own(pair, linux):
    from cluster_fixture import ctl

    a, b = pair
    token = a._envd_access_token
    assert token and token.startswith("dsg.") and token != os.environ["E2B_API_KEY"]
    assert a.commands.run("echo in-a").stdout == "in-a\n"
    a.files.write("/tmp/own", "mine")
    # Another sandbox's token does not open this one, and is no API key.
    r = httpx.get(
        files_url(),
        params={"path": "/tmp/own"},
        headers={"E2b-Sandbox-Id": a.sandbox_id, "X-Access-Token": b._envd_access_token},
    )
    assert r.status_code == 401, r.text
    r = httpx.get(f"{os.environ['E2B_API_URL']}/v2/sandboxes", headers={"X-API-Key": token})
    assert r.status_code == 401, r.text
    r = httpx.get(
        files_url(), params={"path": "/tmp/own"}, headers={"E2b-Sandbox-Id": a.sandbox_id, "X-Access-Token": token}
    )
    assert (r.status_code, r.text) == (200, "mine")

    # At the apiserver: its own sandbox's commands and files, and nothing else.
    # Ours: the last dash of E2B's id is the dot.
    ours = ".".join(a.sandbox_id.rsplit("-", 1))
    theirs = ".".join(b.sandbox_id.rsplit("-", 1))
    r = ctl(linux, "exec", ours, "--", "cat", "/tmp/own", token=token)
    assert (r.returncode, r.stdout) == (0, "mine"), r.stderr
    r = ctl(linux, "sandbox", "get", ours, token=token)
    assert r.returncode == 0, r.stderr
    for args in (
        ("exec", theirs, "--", "true"),
        ("sandbox", "stop", ours),
        ("sandbox", "pause", ours),
        ("sandbox", "list"),
        ("sandbox", "get", theirs),
    ):
        r = ctl(linux, *args, token=token)
        assert r.returncode != 0 and "sandbox access token" in r.stderr, (args, r.stdout, r.stderr)
    forged = token[:-2] + ("AA" if not token.endswith("AA") else "BB")
    r = ctl(linux, "exec", ours, "--", "true", token=forged)
    assert r.returncode != 0 and "not a valid sandbox access token" in r.stderr, r.stderr
    assert a.is_running()


def test_signed_urls_download_and_upload_without_a_token(pair):
    from e2b.sandbox.signature import get_signature

    a, b = pair
    a.files.write("/tmp/signed/f.txt", "signed content")
    # The SDK's URLs name the gateway (E2B_SANDBOX_URL); the sandbox goes in the header, as a
    # `<port>-<sandbox>.<domain>` host would carry it.
    route = {"E2b-Sandbox-Id": a.sandbox_id}
    r = httpx.get(a.download_url("/tmp/signed/f.txt"), headers=route)
    assert (r.status_code, r.text) == (200, "signed content"), r.text
    r = httpx.get(a.download_url("/tmp/signed/f.txt", use_signature_expiration=60), headers=route)
    assert (r.status_code, r.text) == (200, "signed content"), r.text

    up = a.upload_url("/tmp/signed/up.txt")
    r = httpx.post(up, headers=route, files={"file": ("up.txt", b"uploaded")})
    assert r.status_code == 200, r.text
    assert a.files.read("/tmp/signed/up.txt") == "uploaded"

    refused = [
        # Expired a while ago.
        httpx.get(
            files_url(),
            headers=route,
            params={
                "path": "/tmp/signed/f.txt",
                **_signed("/tmp/signed/f.txt", "read", a._envd_access_token, -10, get_signature),
            },
        ),
        # Signed for another path.
        httpx.get(
            files_url(),
            headers=route,
            params={"path": "/etc/hostname", **_signed("/tmp/signed/f.txt", "read", a._envd_access_token, None, get_signature)},
        ),
        # An upload URL used to read, and a download URL used to write.
        httpx.get(up, headers=route),
        httpx.post(a.download_url("/tmp/signed/f.txt"), headers=route, files={"file": ("f.txt", b"overwritten")}),
        # Another sandbox's URL, and another sandbox's token signing this one's.
        httpx.get(b.download_url("/tmp/signed/f.txt"), headers=route),
        httpx.get(
            files_url(),
            headers=route,
            params={"path": "/tmp/signed/f.txt", **_signed("/tmp/signed/f.txt", "read", b._envd_access_token, None, get_signature)},
        ),
        # A signed URL used as another user than the one it was signed for.
        httpx.get(a.download_url("/tmp/signed/f.txt"), headers={**route, "Authorization": "Basic bm9ib2R5Og=="}),
        # A changed expiration.
        httpx.get(
            files_url(),
            headers=route,
            params={
                "path": "/tmp/signed/f.txt",
                "signature": _signed("/tmp/signed/f.txt", "read", a._envd_access_token, 60, get_signature)["signature"],
                "signature_expiration": "99999999999",
            },
        ),
    ]
    for r in refused:
        assert r.status_code == 401, (r.request.url, r.text)
    assert a.files.read("/tmp/signed/f.txt") == "signed content"


def _signed(path: str, op: str, token: str, expires_in, get_signature) -> dict[str, str]:
    s = get_signature(path, op, None, token, expires_in)
    out = {"signature": s["signature"]}
    if s["expiration"] is not None:
        out["signature_expiration"] = str(s["expiration"])
    return out
