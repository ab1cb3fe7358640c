"""Token-level stop conditions, decided next to the scheduler.

Stop *strings* need detokenized text and live in the output processor; everything that
can be decided from token ids lives here:

- EOS (``request.eos_token_ids``, empty when ``ignore_eos``): finish "stop", no stop_reason.
- ``stop_token_ids``: finish "stop", ``stop_reason`` = the token id.
- Both only count once ``num_output_tokens >= min_tokens``.
- ``max_tokens`` output tokens, or ``max_model_len`` tokens in all: finish "length".

A stop token is checked before the length limits, so an EOS sampled as the very last
allowed token reports "stop": the model did end the text there.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedlm.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Whether ``request`` must finish after its last output token; sets its status if so.

    Call after appending each output token (``num_output_tokens >= 1``).
    """
    params = request.sampling_params
    tokens = request.all_token_ids
    num_tokens = len(tokens)
    num_output_tokens = num_tokens - request.num_prompt_tokens
    if num_output_tokens >= params.min_tokens:
        last_token_id = tokens[-1]
        if last_token_id in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = None
            return True
        if params.stop_token_ids and last_token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    if num_output_tokens >= request.max_tokens or num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False


def append_token_ids(request: Request, token_ids: Sequence[int], max_model_len: int) -> list[int]:
    """Append sampled tokens one by one, stopping at the first that finishes the request.

    Several tokens arrive at once when speculative decoding accepts drafts; tokens after
    a stop are dropped. Returns the tokens actually appended (a
    prefix of ``token_ids``).
    """
    if len(token_ids) == 1:  # the common case: one sampled token, no draft accepted
        request.append_output_token_ids(token_ids)
        check_stop(request, max_model_len)
        return list(token_ids)
    params = request.sampling_params
    if (
        len(token_ids) > 1
        and request.num_output_tokens >= params.min_tokens
        and request.eos_token_ids.isdisjoint(token_ids)
        and not (params.stop_token_ids and not set(params.stop_token_ids).isdisjoint(token_ids))
    ):
        # No stop token among them (the common case with accepted drafts): only a length limit can
        # end the request, so append up to it at once instead of checking token by token.
        room = min(
            request.max_tokens - request.num_output_tokens, max_model_len - request.num_tokens
        )
        appended = list(token_ids[:room])
        request.append_output_token_ids(appended)
        if len(appended) == room:
            request.status = RequestStatus.FINISHED_LENGTH
        return appended
    appended = []
    for token_id in token_ids:
        request.append_output_token_ids([token_id])
        appended.append(token_id)
        if check_stop(request, max_model_len):
            break
    return appended
