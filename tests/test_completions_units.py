"""`/v1/completions` without a stack (gateway/completions_api.py): the body as the gateway's
request, the gateway's raw prompt (GenerateRequest.raw_prompt) and the logprobs shape. The
served endpoint, its parity with generate() and its refusals end to end: tests/integration/test_http.py."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from gateway.completions_api import DEFAULT_MAX_TOKENS, CompletionRequest, completion_logprobs, to_completion_request
from gateway.http_error import HttpError
from omnistage.v1 import gateway_pb2

OWN_STOPS = [7, 9]  # a thinker's own stop ids


def _request(**kw: Any) -> gateway_pb2.GenerateRequest:
    return to_completion_request(CompletionRequest.model_validate({"prompt": "Once", **kw}), OWN_STOPS)


def test_the_body_becomes_a_raw_prompt_request_answered_in_text() -> None:
    req = _request(temperature=0, seed=3, stop="END", logprobs=2, top_k=-1, stop_token_ids=[11], top_p=0.5,
                   presence_penalty=0.5, logit_bias={"5": -100})  # fmt: skip
    thinker = req.sampling["thinker"]
    assert req.raw_prompt and req.prompt == "Once" and not req.want_audio and not req.messages
    assert (thinker.max_tokens, thinker.do_sample, thinker.seed, thinker.logprobs) == (DEFAULT_MAX_TOKENS, False, 3, 2)
    assert list(req.stop) == ["END"] and list(thinker.stop_ids) == [*OWN_STOPS, 11]  # besides its own, as vLLM
    assert thinker.top_p == 0.5 and thinker.top_k == 0 and thinker.presence_penalty == 0.5
    assert dict(thinker.logit_bias) == {5: -100}
    assert _request(prompt=["One prompt"]).prompt == "One prompt"
    for ids in ([5, 6, 7], [[5, 6, 7]]):  # token ids (lm-eval's), alone or in a list
        by_ids = _request(prompt=ids)
        assert by_ids.raw_prompt and list(by_ids.prompt_ids) == [5, 6, 7] and not by_ids.prompt
    unset = _request(max_tokens=None)  # null: the checkpoint's default (as chat's), not 16
    assert not unset.sampling["thinker"].HasField("max_tokens") and not unset.sampling["thinker"].HasField("logprobs")
    sampled = _request(temperature=0.7, max_tokens=5)
    assert sampled.sampling["thinker"].do_sample and sampled.sampling["thinker"].max_tokens == 5
    # fields that change nothing pass (OpenAI's SDK and vLLM's clients send them)
    _request(n=1, best_of=1, echo=False, suffix=None, user="u", ignore_eos=False, stream_options=None)


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ["a", "b"]}, "prompt"),  # several prompts: one choice a request
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),  # not a token id
    ({"prompt": []}, "prompt"),
    ({"prompt": "a", "suffix": "z"}, "suffix"),
    ({"prompt": "a", "echo": True, "logprobs": 0}, "echo"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"prompt": "a", "ignore_eos": True}, "ignore_eos"),  # vLLM's, with no counterpart here
    ({"prompt": "a", "min_tokens": 3}, "min_tokens"),
    ({"prompt": "a", "response_format": {"type": "json_object"}}, "response_format"),  # no constrained decoding
    ({"prompt": "a", "max_tokens": 0, "echo": True}, "max_tokens"),  # the prompt's logprobs alone
])  # fmt: skip
def test_what_it_cannot_honour_is_refused_by_name(body: dict[str, Any], param: str) -> None:
    with pytest.raises(HttpError) as e:
        to_completion_request(CompletionRequest.model_validate(body), OWN_STOPS)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_logprobs_in_the_completions_shape() -> None:
    """Per token its text, log-probability, the most likely at its position with the token itself
    (OpenAI's up to logprobs + 1), and where its text starts."""
    entries = [
        {"token": "He", "logprob": -0.5, "top_logprobs": [{"token": "He", "logprob": -0.5},
                                                          {"token": "A", "logprob": -1.0}]},
        # sampled, not the most likely; two alternatives with one text: the likelier counts
        {"token": "llo", "logprob": -2.0, "top_logprobs": [{"token": "\ufffd", "logprob": -0.1},
                                                           {"token": "\ufffd", "logprob": -0.3}]},
    ]  # fmt: skip
    out = completion_logprobs(entries, 4)
    assert out == ({"tokens": ["He", "llo"], "token_logprobs": [-0.5, -2.0],
                    "top_logprobs": [{"He": -0.5, "A": -1.0}, {"\ufffd": -0.1, "llo": -2.0}],
                    "text_offset": [4, 6]}, 9)  # fmt: skip


def test_the_gateway_reads_a_raw_prompt_as_written(tiny_dir: Path) -> None:
    """Special-token text is those tokens (the chat door's text is sanitized of them); a token that
    stands for media, messages, tools or audio with it are refused by name."""
    from gateway.client import build_request
    from gateway.server import GatewayError, GatewayService
    from omnistage.config import parse_config
    from omnistage.models import open_checkpoint

    ckpt = open_checkpoint(tiny_dir)
    spec = ckpt.spec

    async def go() -> None:  # (made in a running loop: its channel binds to it)
        service = GatewayService(parse_config({}), ckpt, "ipv4:127.0.0.1:1")
        raw = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        ids = service._prompt(gateway_pb2.GenerateRequest(prompt=raw, raw_prompt=True)).ids
        assert ids[0] == spec.im_start_id and list(ids).count(spec.im_end_id) == 1
        # the chat template's prompt, written out, reads back as its ids
        chat = ckpt.family.prompt_ids(service.tokenizer, [{"role": "user", "content": "Say hi."}])
        written = service.tokenizer.decode(chat)
        assert list(service._prompt(gateway_pb2.GenerateRequest(prompt=written, raw_prompt=True)).ids) == list(chat)
        assert spec.audio_start_id >= 0  # (the thinker counts each as an audio)
        for media_id in (*spec.multimodal_ids, spec.audio_start_id):
            text = service.tokenizer.convert_ids_to_tokens(media_id)
            with pytest.raises(ValueError, match=re.escape(f"prompt: '{text}' stands for audio, an image or a video")):
                service._prompt(gateway_pb2.GenerateRequest(prompt=f"a {text} b", raw_prompt=True))
        with pytest.raises(ValueError, match="prompt: empty prompt"):
            service._prompt(gateway_pb2.GenerateRequest(prompt="", raw_prompt=True))
        # its ids, given: as they are, each of the vocabulary and none standing for media
        given = gateway_pb2.GenerateRequest(prompt_ids=chat, raw_prompt=True)
        assert list(service._prompt(given).ids) == list(chat)
        too_many = [1] * (service.max_prompt_tokens + 1)  # (refused before its ids are read)
        for bad, why in (([1, spec.thinker_vocab], "outside the vocabulary"), ([1, spec.multimodal_ids[1]], "stands"),
                         (too_many, f"{len(too_many)} tokens exceeds the model maximum")):  # fmt: skip
            with pytest.raises(ValueError, match=f"prompt: .*{why}"):
                service._prompt(gateway_pb2.GenerateRequest(prompt_ids=bad, raw_prompt=True))
        for req, why in ((gateway_pb2.GenerateRequest(prompt_ids=[1], request_id="r"), "is a raw one"),
                         (gateway_pb2.GenerateRequest(prompt_ids=[1], prompt="a", raw_prompt=True, request_id="r"),
                          "not both")):  # fmt: skip
            with pytest.raises(GatewayError, match=f"gateway: prompt_ids: .*{why}"):
                service._start(req, 10)
        for field, value in (("messages", [gateway_pb2.ChatMessage(role="user", content="hi")]),
                             ("tools", ['{"type": "function"}']), ("want_audio", True)):  # fmt: skip
            req = gateway_pb2.GenerateRequest(prompt="hi", raw_prompt=True, request_id="r")
            if isinstance(value, list):
                getattr(req, field).extend(value)
            else:
                setattr(req, field, value)
            with pytest.raises(GatewayError, match=f"gateway: {field}: a raw prompt goes alone"):
                service._start(req, 10)
        with pytest.raises(ValueError, match="raw: a raw prompt goes alone"):  # the gRPC client's
            build_request("hi", raw=True, system="Be brief.")
        assert not build_request("hi", raw=True).want_audio
        await service.router.close()

    asyncio.run(go())
