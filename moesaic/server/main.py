"""`moesaic serve`: the app under uvicorn, a ready line with the URL, and a clean exit on Ctrl-C / SIGTERM.

On a signal uvicorn stops accepting connections and waits up to `drain_timeout` seconds for the requests
in flight (streams included) to finish, then cancels the rest; the app's shutdown stops the engine. The
process then exits 0: uvicorn re-raises the signal it caught once it is done, which here meets a handler
that ignores SIGTERM and a KeyboardInterrupt that is caught.
"""

from __future__ import annotations

import logging
import signal
import sys

import uvicorn

from .app import MAX_BODY_BYTES, MAX_PENDING, build_app

log = logging.getLogger("moesaic.server")


class _Uvicorn(uvicorn.Server):
    def __init__(self, config, srv, url_host: str):
        super().__init__(config)
        self.srv, self.url_host = srv, url_host

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started and self.servers and self.servers[0].sockets:
            port = self.servers[0].sockets[0].getsockname()[1]
            url = f"http://{self.url_host}:{port}"
            print(f"moesaic serve: ready at {url}/v1 (model {', '.join(self.srv.names)})", flush=True)

    def handle_exit(self, sig, frame):
        self.srv.draining = True  # new requests on open connections get 503 while the others finish
        super().handle_exit(sig, frame)


def serve(
    llm,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_keys=None,
    served_model_names=None,
    chat_template: str | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    drain_timeout: float = 30.0,
    max_pending: int = MAX_PENDING,
    max_body_bytes: int = MAX_BODY_BYTES,
    log_level: str = "info",
) -> int:
    """Serves a loaded moesaic.LLM until Ctrl-C or SIGTERM; returns the exit status (0)."""
    app = build_app(
        llm,
        api_keys=api_keys,
        served_model_names=served_model_names,
        chat_template=chat_template,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        max_pending=max_pending,
        max_body_bytes=max_body_bytes,
        drain_timeout=drain_timeout,
    )
    srv = app.state.moesaic
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,  # one line per request comes from the server itself (id, tokens, time)
        timeout_graceful_shutdown=drain_timeout,
        lifespan="on",
    )
    url_host = f"[{host}]" if ":" in host else host
    server = _Uvicorn(config, srv, url_host)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # what uvicorn re-raises after the drain
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        if srv.engine.thread.is_alive():  # the lifespan did not run (startup failed)
            srv.engine.shutdown(timeout=0)
    if not server.started:
        print("moesaic serve: the server did not start", file=sys.stderr)
        return 1
    log.info("moesaic serve: stopped")
    return 0
