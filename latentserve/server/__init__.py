"""OpenAI-compatible HTTP server: `build_app(engine, model_name)` for an app; `serve(engine, model_name, config)`
or `run_server(model_dir, engine_config, config)` to serve until SIGTERM."""
from latentserve.server.api import build_app
from latentserve.server.async_engine import AsyncLLMEngine
from latentserve.server.launcher import ServerConfig, run_server, serve

__all__ = ["AsyncLLMEngine", "ServerConfig", "build_app", "run_server", "serve"]
