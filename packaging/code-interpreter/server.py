"""OpenDsec's code interpreter server (docs/e2b.md "Code interpreter").

It runs inside a sandbox of the `code-interpreter-v1` template and speaks the HTTP API that
E2B's code-interpreter SDKs call on port 49999, over Jupyter kernels driven by jupyter_client
(the kernels are ipykernel's, or any other kernel the image has):

- `POST /execute` `{"code", "context_id", "language", "env_vars"}` streams one JSON object
  per line while the code runs: `stdout`/`stderr` (`text`, `timestamp`), `result` (the
  display data: `text`, `html`, `markdown`, `svg`, `png`, `jpeg`, `pdf`, `latex`, `json`,
  `javascript`, `data`, `chart`, `is_main_result`; other MIME types under `extra`),
  `error` (`name`, `value`, `traceback`), `number_of_executions`, and `end_of_execution`
  last. A client that goes away interrupts the kernel.
- `POST /contexts` `{"language", "cwd"}`, `GET /contexts`, `POST /contexts/<id>/restart`,
  `DELETE /contexts/<id>`: kernels of their own, each keeping its state between calls.
- `GET /health`.

The gateway carries requests here over the sandbox's loopback; this server listens on
127.0.0.1 only. Usage: `python3 server.py [--port 49999] [--cwd DIR]`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import queue
import sys
import time
import uuid
from typing import Any, Callable, Optional

import tornado.httpserver
import tornado.iostream
import tornado.web
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

# Display data MIME types and the keys E2B's SDKs read them under.
MIME_KEYS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "application/vnd.opendsec.data+json": "data",
    "application/vnd.opendsec.chart+json": "chart",
}

# The IPython startup files of this template (pandas tables as data), for every kernel.
IPYTHONDIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ipython")


def kernel_for(language: str) -> Optional[str]:
    """The kernel spec whose language is `language` (case-insensitive), if the image has one."""
    specs = KernelSpecManager().get_all_specs()
    for name, s in sorted(specs.items()):
        if s.get("spec", {}).get("language", "").lower() == language:
            return name
    return None


class KernelDied(Exception):
    """The kernel went away while it ran something."""


class Context:
    """One kernel, and the lock that runs its executions one at a time."""

    def __init__(self, language: str, cwd: str) -> None:
        self.id = uuid.uuid4().hex
        self.language = language
        self.cwd = cwd
        self.km: Optional[AsyncKernelManager] = None
        self.lock = asyncio.Lock()

    def json(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    async def start(self) -> None:
        name = kernel_for(self.language)
        if name is None:
            raise LookupError(self.language)
        self.km = AsyncKernelManager(kernel_name=name)
        env = {**os.environ, "IPYTHONDIR": IPYTHONDIR}
        await self.km.start_kernel(cwd=self.cwd, env=env)
        kc = self.km.client()
        kc.start_channels()
        await kc.wait_for_ready(timeout=60)
        self.client = kc

    async def stop(self) -> None:
        if self.km is not None:
            self.client.stop_channels()
            await self.km.shutdown_kernel(now=True)

    async def restart(self) -> None:
        async with self.lock:
            await self.restart_locked()

    async def restart_locked(self) -> None:
        """Restarts the kernel (its state is lost), the lock held by the caller."""
        assert self.km is not None
        self.client.stop_channels()
        await self.km.restart_kernel(now=True)
        kc = self.km.client()
        kc.start_channels()
        await kc.wait_for_ready(timeout=60)
        self.client = kc

    async def run(self, code: str, silent: bool, emit: Callable[[dict[str, Any]], None]) -> None:
        """Runs `code` and passes what the kernel says about it to `emit`, until the kernel
        is idle again."""
        msg_id = self.client.execute(code, silent=silent, store_history=not silent, allow_stdin=False)
        while True:
            try:
                msg = await self.client.get_iopub_msg(timeout=1)
            except queue.Empty:
                # A kernel killed from inside (os._exit, a crash, the OOM killer) never
                # says idle again: look whether it is still there.
                if self.km is not None and not await self.km.is_alive():
                    raise KernelDied() from None
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            # Unix nanoseconds, as the SDKs type it.
            date = msg["header"].get("date")
            stamp = int(date.timestamp() * 1e9) if isinstance(date, datetime.datetime) else time.time_ns()
            if kind == "status" and content.get("execution_state") == "idle":
                return
            if silent:
                continue
            if kind == "stream":
                stream = "stderr" if content.get("name") == "stderr" else "stdout"
                emit({"type": stream, "text": content.get("text", ""), "timestamp": stamp})
            elif kind in ("execute_result", "display_data"):
                emit(result_of(content.get("data", {}), kind == "execute_result"))
            elif kind == "error":
                emit(
                    {
                        "type": "error",
                        "name": content.get("ename", ""),
                        "value": content.get("evalue", ""),
                        "traceback": "\n".join(content.get("traceback", [])),
                    }
                )
            elif kind == "execute_input":
                emit({"type": "number_of_executions", "execution_count": content.get("execution_count", 0)})


def result_of(data: dict[str, Any], main: bool) -> dict[str, Any]:
    """A display message's data as E2B's `result`."""
    out: dict[str, Any] = {"type": "result", "is_main_result": main}
    extra: dict[str, Any] = {}
    for mime, value in data.items():
        key = MIME_KEYS.get(mime)
        if key is None:
            extra[mime] = value
        else:
            out[key] = value
    if extra:
        out["extra"] = extra
    return out


def env_code(language: str, env: dict[str, str]) -> tuple[str, str]:
    """Code that sets `env` in a kernel of `language` for one execution, and code that puts
    back what was there. Empty for a language this server does not know how to do it for."""
    if language == "python":
        set_ = (
            "import os as __od_os\n"
            f"__od_saved = {{k: __od_os.environ.get(k) for k in {sorted(env)!r}}}\n"
            f"__od_os.environ.update({env!r})\n"
        )
        back = (
            "for __od_k, __od_v in __od_saved.items():\n"
            "    if __od_v is None: __od_os.environ.pop(__od_k, None)\n"
            "    else: __od_os.environ[__od_k] = __od_v\n"
            "del __od_saved, __od_os\n"
        )
        return set_, back
    if language == "bash":
        import shlex

        set_ = "".join(
            f"__od_old_{i}=${{{k}-__od_unset}}; export {k}={shlex.quote(v)}\n" for i, (k, v) in enumerate(env.items())
        )
        back = "".join(
            f'if [ "$__od_old_{i}" = __od_unset ]; then unset {k}; else export {k}="$__od_old_{i}"; fi; unset __od_old_{i}\n'
            for i, k in enumerate(env)
        )
        return set_, back
    return "", ""


class Server:
    def __init__(self, cwd: str) -> None:
        self.cwd = cwd
        self.contexts: dict[str, Context] = {}
        self.defaults: dict[str, Context] = {}
        self.starting = asyncio.Lock()

    async def new_context(self, language: str, cwd: str) -> Context:
        ctx = Context(language, cwd)
        await ctx.start()
        self.contexts[ctx.id] = ctx
        return ctx

    async def default_context(self, language: str) -> Context:
        async with self.starting:
            ctx = self.defaults.get(language)
            if ctx is None or ctx.id not in self.contexts:
                ctx = await self.new_context(language, self.cwd)
                self.defaults[language] = ctx
            return ctx


def language_of(v: Any) -> str:
    lang = (v or "python").lower() if isinstance(v, str) or v is None else ""
    return {"js": "javascript", "ts": "typescript", "sh": "bash"}.get(lang, lang)


class Base(tornado.web.RequestHandler):
    def initialize(self, server: Server) -> None:
        self.server = server

    def fail(self, status: int, message: str) -> None:
        # Plain text, as E2B's server answers its errors (the SDKs show the body).
        self.set_status(status)
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.finish(message)

    def body(self) -> Optional[dict[str, Any]]:
        try:
            v = json.loads(self.request.body or b"{}")
        except ValueError:
            self.fail(400, "the body is not JSON")
            return None
        if not isinstance(v, dict):
            self.fail(400, "the body is not a JSON object")
            return None
        return v


class Health(Base):
    def get(self) -> None:
        self.finish("OK")


class Execute(Base):
    async def post(self) -> None:
        req = self.body()
        if req is None:
            return
        code, context_id, env = req.get("code"), req.get("context_id"), req.get("env_vars") or {}
        if not isinstance(code, str):
            return self.fail(400, "code must be a string")
        if context_id is not None and (not isinstance(context_id, str) or not context_id):
            return self.fail(400, "context_id must be a context's id")
        if req.get("language") is not None and not isinstance(req.get("language"), str):
            return self.fail(400, "language must be a string")
        if context_id and req.get("language"):
            return self.fail(400, "context_id and language exclude each other")
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            return self.fail(400, "env_vars must map names to strings")
        if context_id:
            ctx = self.server.contexts.get(context_id)
            if ctx is None:
                return self.fail(404, f"context {context_id} not found")
        else:
            lang = language_of(req.get("language"))
            try:
                ctx = await self.server.default_context(lang)
            except LookupError:
                return self.fail(400, f"no kernel for language {lang!r} in this template")
        self.set_header("Content-Type", "application/x-ndjson")
        lines: asyncio.Queue[Optional[dict[str, Any]]] = asyncio.Queue()

        async def work() -> None:
            async with ctx.lock:
                set_env, put_back = env_code(ctx.language, env) if env else ("", "")
                try:
                    if set_env:
                        await ctx.run(set_env, True, lambda _m: None)
                    await ctx.run(code, False, lines.put_nowait)
                    if put_back:
                        await ctx.run(put_back, True, lambda _m: None)
                except KernelDied:
                    # The context stays usable: a fresh kernel under the same id, its state
                    # gone, which the caller learns from this error.
                    lines.put_nowait(
                        {
                            "type": "error",
                            "name": "KernelDied",
                            "value": "the kernel died while running the code; it was restarted and its state is lost",
                            "traceback": "",
                        }
                    )
                    try:
                        await ctx.restart_locked()
                    except Exception as e:  # noqa: BLE001 - reported on the next execution
                        print(f"restarting a dead kernel of context {ctx.id}: {e!r}", file=sys.stderr)
                finally:
                    lines.put_nowait({"type": "end_of_execution"})
                    lines.put_nowait(None)

        task = asyncio.ensure_future(work())
        self.gone = asyncio.Event()
        interrupted = False
        while True:
            get = asyncio.ensure_future(lines.get())
            gone = asyncio.ensure_future(self.gone.wait())
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
            gone.cancel()
            if self.gone.is_set() and not interrupted:
                # The caller went (its timeout, or it was killed): stop what it started.
                interrupted = True
                if ctx.km is not None:
                    await ctx.km.interrupt_kernel()
            if get not in done:
                continue
            item = get.result()
            if item is None:
                break
            if interrupted:
                continue
            try:
                self.write(json.dumps(item) + "\n")
                await self.flush()
            except tornado.iostream.StreamClosedError:
                self.gone.set()
        await task
        if not self._finished and not interrupted:
            self.finish()

    def on_connection_close(self) -> None:
        gone = getattr(self, "gone", None)
        if gone is not None:
            gone.set()


class Contexts(Base):
    async def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps([c.json() for c in self.server.contexts.values()]))

    async def post(self) -> None:
        req = self.body()
        if req is None:
            return
        lang = language_of(req.get("language"))
        cwd = req.get("cwd") or self.server.cwd
        if not isinstance(cwd, str):
            return self.fail(400, "cwd must be a string")
        try:
            ctx = await self.server.new_context(lang, cwd)
        except LookupError:
            return self.fail(400, f"no kernel for language {lang!r} in this template")
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(ctx.json()))


class OneContext(Base):
    async def delete(self, id: str) -> None:
        ctx = self.server.contexts.pop(id, None)
        if ctx is None:
            return self.fail(404, f"context {id} not found")
        await ctx.stop()
        self.set_status(204)
        self.finish()


class Restart(Base):
    async def post(self, id: str) -> None:
        ctx = self.server.contexts.get(id)
        if ctx is None:
            return self.fail(404, f"context {id} not found")
        await ctx.restart()
        self.set_status(204)
        self.finish()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=49999)
    p.add_argument("--cwd", default=os.getcwd())
    a = p.parse_args()
    server = Server(a.cwd)
    # The default Python kernel first: the template's ready port opens once it runs.
    await server.default_context("python")
    args = {"server": server}
    app = tornado.web.Application(
        [
            (r"/health", Health, args),
            (r"/execute", Execute, args),
            (r"/contexts", Contexts, args),
            (r"/contexts/([0-9a-f]+)/restart", Restart, args),
            (r"/contexts/([0-9a-f]+)", OneContext, args),
        ]
    )
    http = tornado.httpserver.HTTPServer(app, max_body_size=64 << 20)
    http.listen(a.port, address="127.0.0.1")
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
