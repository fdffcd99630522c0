"""One request's talker progress, fed by thinker outputs as they arrive.

Shared by the in-process pipeline and the talker service so the ordering rules live in one
place: the talker prefills once the assistant stream has its header plus the first generated
token; talker step g then needs assistant-stream element `HEADER + 1 + g` (thinker token g+1),
or the knowledge that the thinker has finished (then tts_pad). A frame is handed out as soon
as its residual codes exist, before the next thinker token is needed.
"""

from __future__ import annotations

import torch

from omnistage.families.qwen3_omni import ASSISTANT_HEADER_LEN, assistant_start
from services.runtime.sampling import SamplingParams
from services.talker.runner import TalkerRequest, TalkerRunner


class TalkerSession:
    def __init__(self, runner: TalkerRunner, sampling: SamplingParams, speaker: str) -> None:
        self.runner = runner
        self.req: TalkerRequest = runner.new_request(sampling, speaker)
        self.prompt: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        self.header: torch.Tensor | None = None  # layer-0 embeds of the prompt's assistant header
        self.tokens: list[tuple[torch.Tensor, bool]] = []  # generated tokens: (embed [H], is_last)
        self.thinker_done = False
        self.started = False

    # ---- inputs ---------------------------------------------------------------------------

    def set_prompt(self, ids: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor | None) -> None:
        self.prompt = (ids, embeds, hidden)
        self.header = embeds[assistant_start(ids, self.runner.spec) :]

    def add_token(self, embed: torch.Tensor, is_last: bool) -> None:
        self.tokens.append((embed, is_last))
        if is_last:
            self.thinker_done = True

    # ---- progress -------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.req.finished

    @property
    def stopped_on(self) -> str | None:
        return self.req.stopped_on

    def _element(self, k: int) -> tuple[torch.Tensor, bool] | None:
        assert self.header is not None
        if k < self.header.shape[0]:
            return self.header[k], False
        i = k - self.header.shape[0]
        return self.tokens[i] if i < len(self.tokens) else None

    def can_progress(self) -> bool:
        if self.finished or self.prompt is None:
            return False
        if not self.started:
            return self._element(ASSISTANT_HEADER_LEN) is not None or self.thinker_done
        if self.req.pending_frame is None:
            return True
        return self.thinker_done or self._element(ASSISTANT_HEADER_LEN + 1 + self.req.step) is not None

    def step(self) -> torch.Tensor | None:
        """One unit of progress alone; returns a newly completed frame or None."""
        return step_sessions(self.runner, [self])[0]

    def _prefill_rows(self) -> torch.Tensor | None:
        """The talker prompt once the assistant stream has its header plus the first generated
        token; None (and, if the thinker gave only one token, finished) before that."""
        needed = [self._element(k) for k in range(ASSISTANT_HEADER_LEN + 1)]
        if any(e is None for e in needed) or any(last for _, last in needed):  # type: ignore[misc]
            if self.thinker_done:
                # The reference cannot speak a reply of a single token: no audio, no error.
                self.req.finished, self.req.stopped_on = True, "no_text"
            return None
        assert self.prompt is not None
        ids, embeds, hidden = self.prompt
        stream = torch.stack([e for e, _ in needed])  # type: ignore[misc]
        return self.runner.prefill_embeds(self.req, ids, embeds, hidden, stream)

    def _advance_rows(self) -> torch.Tensor | None:
        """The pending frame fed back with trailing text g+1, once that text (or the end) is known."""
        element = self._element(ASSISTANT_HEADER_LEN + 1 + self.req.step)
        if element is None and not self.thinker_done:
            return None
        embed, is_last = element if element is not None else (None, False)
        assert self.req.pending_frame is not None
        trailing = self.runner.prompts.trailing_embed(embed, is_last)
        rows = self.runner.advance_embeds(self.req, self.req.pending_frame, trailing)
        self.req.pending_frame = None
        self.req.step += 1
        return rows

    def close(self) -> None:
        self.runner.release(self.req)


def step_sessions(runner: TalkerRunner, sessions: list[TalkerSession]) -> list[torch.Tensor | None]:
    """One step for many sessions: a batched code-predictor pass completes the frame of every
    session that has a code-0, then one packed talker forward runs every talker prompt and every
    completed frame whose trailing text is known. Returns each session's new frame or None."""
    frames: list[torch.Tensor | None] = [None] * len(sessions)
    due = [i for i, s in enumerate(sessions) if s.started and not s.finished and s.req.pending_frame is None]
    if due:
        for i, frame in zip(due, runner.residuals_many([sessions[i].req for i in due]), strict=True):
            sessions[i].req.pending_frame = frames[i] = frame
    rows = []
    for s in sessions:
        if s.finished:
            continue
        embeds = s._prefill_rows() if not s.started else s._advance_rows()
        if embeds is not None:
            s.started = True
            rows.append((s.req, embeds))
    if rows:
        runner.forward_many(rows)
    return frames
