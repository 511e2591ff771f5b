"""POST /tokenize and /detokenize (vLLM's shapes)."""
from __future__ import annotations

import asyncio

from latentserve.server.protocol import DetokenizeRequest, TokenizeRequest
from latentserve.server.protocol_responses import DetokenizeResponse, TokenizeResponse
from latentserve.server.serving import OpenAIError, Serving, encode


class ServingTokens(Serving):
    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self._check(req.model)
        if req.messages is not None:
            text = await self.render(req.messages, req)
            add_special_tokens = bool(req.add_special_tokens) if "add_special_tokens" in req.model_fields_set else False
        else:
            text, add_special_tokens = req.prompt, req.add_special_tokens
        token_ids = await asyncio.to_thread(lambda: encode(self.tokenizer, text, add_special_tokens)[1]())
        strs = [self.tokenizer.tokenizer.id_to_token(t) for t in token_ids] if req.return_token_strs else None
        return TokenizeResponse(count=len(token_ids), max_model_len=self.engine.engine.max_model_len,
                                tokens=token_ids, token_strs=strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self._check(req.model)
        vocab_size = self.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(400, f"tokens: ids {bad[:5]} are outside the vocabulary (size {vocab_size})",
                              param="tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(self.tokenizer.decode, req.tokens, False))

    def _check(self, model: str | None) -> None:
        if model is not None:
            self.check_model(model)
        if self.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer")
