"""Admission shared by every API: prompt tokens + sampling -> a submitted, resumable request."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from opentelemetry import trace
from starlette.requests import Request

from libs.protocol.messages import SamplingParams, SubmitStatus
from libs.protocol.stream_messages import StreamRecord
from libs.recipe.api.common import UNSUPPORTED_INPUT
from libs.recipe.conversation import Conversation
from libs.recipe.fields import ApiError
from libs.recipe.sampling import Sampling
from libs.recipe.template_format import Prompt
from libs.runtime.logs import set_request_id
from libs.runtime.tracing import current_traceparent
from services.gateway.cache_scope import UNSCOPED, CacheScope, CacheScoping, KeyStyle
from services.gateway.caller import ANONYMOUS, Caller, caller_of
from services.gateway.image_admission import ImageAdmission
from services.gateway.request_stream import RequestStream
from services.gateway.served_model import ServedModel
from services.gateway.service import GatewayService, SubmitRejected

# submit status -> (HTTP status, error type, code)
_REJECTED: dict[SubmitStatus, tuple[int, str, str | None]] = {
    SubmitStatus.QUEUE_FULL: (429, "rate_limit_error", "queue_full"),
    SubmitStatus.NO_WORKERS: (503, "server_error", "no_workers"),
    SubmitStatus.INVALID: (400, "invalid_request_error", None),
}


@dataclass(frozen=True, slots=True)
class Admitted:
    record: StreamRecord
    stream: RequestStream


class Admission:
    def __init__(
        self,
        service: GatewayService,
        served: ServedModel,
        scoping: CacheScoping | None = None,
        images: ImageAdmission | None = None,
    ) -> None:
        """``images``: how a prompt's images are checked and encoded (None: images are refused)."""
        self.service = service
        self.served = served
        self.scoping = scoping or CacheScoping()
        self.images = images

    def scope(self, request: Request, style: KeyStyle, requested: str | None = None) -> CacheScope:
        """The request's tenant and retention class (``requested``: the body's retention, if any)."""
        return self.scoping.scope(request.headers, style, requested, caller_of(request).tenant)

    def tenant(self, request: Request, style: KeyStyle) -> str:
        return self.scoping.tenant(request.headers, style, caller_of(request).tenant)

    async def prompt(
        self, conversation: Conversation, format_param: str = "response_format", encode_images: bool = True
    ) -> Prompt:
        """The prompt's tokens, its images expanded into their placeholder runs and (unless
        ``encode_images`` is off: count_tokens) encoded."""
        # Rendering and tokenizing a long prompt, and checking its output constraint, are CPU
        # work: keep them off the event loop.
        prompt = await asyncio.to_thread(self.served.prompt, conversation, format_param)
        if not prompt.images:
            return prompt
        vision = self.served.vision
        if self.images is None or vision is None:
            raise ApiError(400, UNSUPPORTED_INPUT.format(kind="image"), param=prompt.images[0].param)
        # Too long once expanded: refused before any image is encoded.
        self.served.check_length(
            len(prompt.token_ids) + len(prompt.images) * (vision.num_image_tokens - 1), None
        )
        return await self.images.prepare(prompt, encode_images)

    async def admit(
        self,
        api: str,
        request_id: str,
        prompt: Prompt,
        sampling: Sampling,
        *,
        created: int,
        resumable: bool,
        include_usage: bool = False,
        context: bytes = b"",
        background: bool = False,
        scope: CacheScope = UNSCOPED,
        prediction: str = "",
        caller: Caller = ANONYMOUS,
    ) -> Admitted:
        """Submit the request; ``prediction``: the output the client expects (Predicted Outputs);
        ``caller``: who sent it (its key's priority orders it in the scheduler's queue)."""
        set_request_id(request_id)  # the rest of this HTTP request's log lines are about it
        trace.get_current_span().set_attribute("deepinfer.request_id", request_id)
        served = self.served
        params = self._params(prompt, sampling)
        record = StreamRecord(
            request_id=request_id,
            api=api,
            gateway_id=self.service.gateway_id,
            # Taken before the submit: the request's outputs all come after it in the out stream.
            start_seq=self.service.next_out_seq() if resumable else 0,
            created=created,
            model=served.name,
            n=params.n,
            logprobs=params.logprobs,
            top_logprobs=params.top_logprobs,
            include_usage=include_usage,
            stop=tuple(sampling.stop),
            syntax=prompt.syntax,
            start=prompt.start,
            parse_tool_calls=prompt.parse_tool_calls,
            thinking=prompt.thinking,
            context=context,
            background=background,
            tenant=scope.tenant,
        )
        prediction_token_ids = await self._prediction(prediction) if prediction else None
        try:
            stream = await self.service.submit(
                request_id,
                prompt.token_ids,
                params,
                served.eos_token_id,
                record if resumable else None,
                tenant=scope.tenant,
                retention_class=scope.retention_class,
                prediction_token_ids=prediction_token_ids,
                priority=caller.priority,
                tenant_weight=caller.weight,
                traceparent=current_traceparent(),
                image_spans=prompt.image_spans,
            )
        except SubmitRejected as exc:
            status, type_, code = _REJECTED[exc.status]
            raise ApiError(status, str(exc), code=code, type_=type_) from exc
        return Admitted(record, stream)

    def _params(self, prompt: Prompt, sampling: Sampling) -> SamplingParams:
        """The request's sampling parameters, checked against the model (vocabulary, length)."""
        served = self.served
        # Every API's raw token ids meet the vocabulary here (rendered prompts pass trivially).
        served.check_token_ids(prompt.token_ids, sampling.base)
        params = sampling.resolve(served.check_length(len(prompt.token_ids), sampling.max_tokens))
        if prompt.structured_output is not None:
            # The grammar decides where the output ends: a finished grammar allows only stop
            # tokens, which ignore_eos or min_tokens would forbid.
            for name, value in (("ignore_eos", params.ignore_eos), ("min_tokens", params.min_tokens)):
                if value:
                    raise ApiError(400, f"'{name}' cannot be combined with a structured output", param=name)
            params = replace(params, structured_output=prompt.structured_output)
        return params

    async def _prediction(self, text: str) -> list[int]:
        """A prediction's tokens, as the model would write that text (special tokens' spellings
        are those tokens: a draft is only ever a guess the model checks). No longer than a whole
        context can hold."""
        token_ids = await asyncio.to_thread(self.served.tokenizer.encode, text, False)
        if len(token_ids) > self.served.max_model_len:
            why = f"the prediction is {len(token_ids)} tokens; the context holds {self.served.max_model_len}"
            raise ApiError(400, why, param="prediction")
        return token_ids
