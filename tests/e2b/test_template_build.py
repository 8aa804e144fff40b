"""E2B's template builder (`Template()` and `Template.build`) through the gateway's template
build API (docs/e2b.md "Template builds"), in real containers: every step type the gateway
runs, the uploaded files, the logs, the failures the SDK raises, and sandboxes started from
the built template by its name and by its tags."""

from __future__ import annotations

import os
import stat

import pytest

e2b = pytest.importorskip("e2b")
if not hasattr(e2b, "Template"):
    pytest.skip("this SDK release has no template builder", allow_module_level=True)

from e2b import BuildException, Sandbox, Template, wait_for_file


@pytest.fixture()
def context(tmp_path):
    """A build context: a file, and a directory with an executable and a hidden file."""
    (tmp_path / "local.txt").write_text("hello from COPY\n")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "run.sh").write_text("#!/bin/sh\necho ran\n")
    os.chmod(sub / "run.sh", 0o755)
    (sub / ".hidden").write_text("h")
    (sub / "notes.md").write_text("md")
    return tmp_path


def test_every_step_type_builds_an_image_that_sandboxes_start_from(bash_image, context):
    logs: list = []
    t = (
        Template(file_context_path=str(context))
        .from_image(bash_image)
        .run_cmd("echo hi > /x && echo built-output")
        .copy("local.txt", "/app/local.txt")
        .copy("sub", "/app/sub")
        .copy("sub/*.md", "/documents/")
        .set_envs({"GREETING": "hello world", "A": "1"})
        .run_cmd('echo "$GREETING" > /env-at-build')
        .set_user("alice")
        .set_workdir("/home/alice/w")
        .copy("local.txt", "mine.txt", mode=0o600)
        .set_start_cmd("echo started > started-$A; exec sleep 1000", wait_for_file("/home/alice/w/started-1"))
    )
    info = Template.build(t, "tpl-steps", tags=["extra"], on_build_logs=logs.append)
    assert info.name == "tpl-steps" and set(info.tags) == {"default", "extra"}
    messages = [e.message for e in logs]
    assert "built-output" in messages, messages
    assert any("RUN echo hi" in m for m in messages), messages
    assert Template.exists("tpl-steps") and Template.exists("tpl-steps:extra")
    assert not Template.exists("tpl-never-built")

    for name in ("tpl-steps", "tpl-steps:extra"):
        sbx = Sandbox.create(name)
        try:
            # The image's user, working directory and environment are the template's.
            r = sbx.commands.run("id -un; pwd; echo $A $GREETING; cat started-1")
            assert r.stdout == "alice\n/home/alice/w\n1 hello world\nstarted\n"
            r = sbx.commands.run(
                "cat /x /env-at-build /app/local.txt /home/alice/w/mine.txt /documents/notes.md; echo; "
                "ls -A /app/sub /documents; /app/sub/run.sh",
                user="root",
            )
            assert r.stdout == (
                "hi\nhello world\nhello from COPY\nhello from COPY\nmd\n"
                "/app/sub:\n.hidden\nnotes.md\nrun.sh\n\n/documents:\nnotes.md\nran\n"
            ), r.stdout
            mine = sbx.files.get_info("/home/alice/w/mine.txt")
            assert (mine.owner, mine.permissions) == ("alice", "-rw-------")
            assert stat.S_IMODE(int(sbx.commands.run("stat -c %a /app/sub/run.sh").stdout, 8)) == 0o755
        finally:
            sbx.kill()


def test_a_second_build_of_the_same_files_uploads_nothing(bash_image, context):
    t = Template(file_context_path=str(context)).from_image(bash_image).copy("local.txt", "/l.txt")
    Template.build(t, "tpl-cache")
    logs: list = []
    Template.build(t, "tpl-cache:v2", on_build_logs=logs.append)
    assert any("Skipping upload of 'local.txt'" in e.message for e in logs), [e.message for e in logs]
    sbx = Sandbox.create("tpl-cache:v2")
    try:
        assert sbx.files.read("/l.txt") == "hello from COPY\n"
    finally:
        sbx.kill()


def test_a_failing_step_fails_the_build_naming_it(bash_image):
    t = Template().from_image(bash_image).run_cmd("echo fine").run_cmd("echo broken >&2; exit 3")
    logs: list = []
    with pytest.raises(BuildException) as ei:
        Template.build(t, "tpl-fails", on_build_logs=logs.append)
    assert "exited with 3" in str(ei.value), ei.value
    assert "broken" in [e.message for e in logs]
    assert not Template.exists("tpl-fails")


def test_what_the_gateway_cannot_build_is_refused_by_name(linux, bash_image):
    with pytest.raises(BuildException) as ei:
        Template.build(Template().from_image(bash_image, username="u", password="p"), "tpl-registry")
    assert "fromImageRegistry" in str(ei.value)
    with pytest.raises(BuildException) as ei:
        Template.build(Template().from_image("debian:bookworm"), "tpl-hub")
    assert "import it" in str(ei.value)
    with pytest.raises(BuildException) as ei:
        Template.build(Template().from_image(bash_image), "team/tpl")
    assert "caller's project" in str(ei.value)
    # The node-local development image `base` is no store image to build on.
    with pytest.raises(BuildException) as ei:
        Template.build(Template().from_template("base"), "tpl-on-host")
    assert "store image" in str(ei.value)


def test_builds_that_change_no_files_chain_and_start(bash_image):
    """Each build of a template that changed nothing packs the same empty layer its base
    ended with; sandboxes of the chain still start."""
    Template.build(Template().from_image(bash_image).run_cmd("true"), "tpl-chain-a")
    Template.build(Template().from_template("tpl-chain-a").run_cmd("true"), "tpl-chain-b")
    Template.build(Template().from_template("tpl-chain-b").set_envs({"CHAIN": "c"}), "tpl-chain-c")
    sbx = Sandbox.create("tpl-chain-c")
    try:
        assert sbx.commands.run("echo $CHAIN; cat /srv/from-image").stdout == "c\nimage\n"
    finally:
        sbx.kill()


def test_refused_builds_hold_no_place_and_config_names_are_refused(bash_image):
    # More refused builds than a caller may run at once: each is over when refused.
    for _ in range(6):
        with pytest.raises(BuildException) as ei:
            Template.build(Template().from_image(bash_image, username="u", password="p"), "tpl-refused")
        assert "fromImageRegistry" in str(ei.value)
    Template.build(Template().from_image(bash_image).run_cmd("true"), "tpl-after-refusals")
    with pytest.raises(BuildException) as ei:
        Template.build(Template().from_image(bash_image), "base")
    assert "config" in str(ei.value), ei.value
