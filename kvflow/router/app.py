"""The router's HTTP app: `kvflow.api.server.build_app` over a `RouterBackend` (the OpenAI routes, /health, /metrics,
the API key, the drain) plus the pool's admin routes, behind the same key:

- `GET /router/instances`: each instance's URL, health, queue and requests open there;
- `POST /router/instances` `{"url": ..., "role": ...}`: an instance joins (used from the next request on; 400 if it
  does not answer /v1/models with the pool's model), in its role (mixed by default, or prefill / decode);
- `POST /router/instances/role` `{"url": ..., "role": ...}`: an instance changes role, draining first;
- `DELETE /router/instances` `{"url": ...}`: no more requests go there (those open there finish).
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel

from kvflow.api.errors import APIError, bad_request
from kvflow.api.server import APIConfig, build_app, serve
from kvflow.router.backend import RouterBackend


class InstanceBody(BaseModel):
    url: str
    role: str | None = None


def build_router_app(backend: RouterBackend, config: APIConfig = APIConfig()) -> FastAPI:
    app = build_app(backend, config)
    pool = backend.pool

    @app.get("/router/instances")
    async def instances() -> dict:
        return {"policy": backend.config.policy, "instances": [
            {"url": i.url, "role": i.role, "next_role": i.next_role, "healthy": i.healthy, "waiting": i.waiting,
             "running": i.running,
             "in_flight": len(i.flights), "routed_total": i.routed_total, "failures_total": i.failures_total}
            for i in pool.instances.values()]}

    @app.post("/router/instances")
    async def join(body: InstanceBody) -> dict:
        try:
            inst = await pool.add(body.url, body.role)
        except ValueError as e:
            raise bad_request(str(e), "url") from e
        return {"url": inst.url, "role": inst.role, "healthy": inst.healthy}

    @app.post("/router/instances/role")
    async def role(body: InstanceBody) -> dict:
        if body.role is None:
            raise bad_request("a role is needed: mixed, prefill or decode", "role")
        try:
            inst = pool.set_role(body.url, body.role)
        except ValueError as e:
            raise bad_request(str(e), "role") from e
        except KeyError:
            raise APIError(404, f"no instance {body.url} in the pool", "invalid_request_error", "url", "not_found") from None
        return {"url": inst.url, "role": inst.role, "next_role": inst.next_role}

    @app.delete("/router/instances")
    async def leave(body: InstanceBody) -> dict:
        try:
            removed = pool.remove(body.url)
        except ValueError as e:
            raise bad_request(str(e), "url") from e
        if not removed:
            raise APIError(404, f"no instance {body.url} in the pool", "invalid_request_error", "url", "not_found")
        return {"url": body.url, "removed": True}

    return app


def serve_router(backend: RouterBackend, host: str, port: int, log_level: str = "info",
                 config: APIConfig = APIConfig()) -> int:
    """Serve until SIGTERM / Ctrl-C with `kvflow serve`'s drain and exit codes — except that the router keeps
    running (answering 503) while no instance is healthy, since instances may come back or join."""
    return serve(backend, host, port, log_level, config, build=build_router_app, exit_on_backend_failure=False)
