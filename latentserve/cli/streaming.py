"""Driving the engine step by step and showing each request's text as it grows."""
from __future__ import annotations

from typing import Callable

from latentserve.cli.args import CLIError, write
from latentserve.engine.llm_engine import LLMEngine
from latentserve.engine.outputs import RequestOutput


def run_engine(engine: LLMEngine, on_output: Callable[[RequestOutput], None]) -> None:
    """Step until every request has finished, handing each update to `on_output`."""
    while engine.has_unfinished_requests():
        for output in engine.step():
            on_output(output)


class TextStreamer:
    """Writes the part of one request's text not shown yet (the engine holds back what it may take back)."""

    def __init__(self) -> None:
        self.shown = 0
        self.last: RequestOutput | None = None

    def __call__(self, output: RequestOutput) -> None:
        self.last = output
        text = output.outputs[0].text
        if len(text) > self.shown:
            write(text[self.shown :])
            self.shown = len(text)


def check_finished(output: RequestOutput) -> None:
    """A request the engine could not run (e.g. more KV blocks than the cache holds) is the user's to fix."""
    if output.outputs[0].finish_reason == "error":
        raise CLIError(output.error or f"request {output.request_id} failed")
