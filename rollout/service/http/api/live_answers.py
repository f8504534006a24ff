"""The HTTP requests in progress, by their answers' ids (`cmpl-...`, `chatcmpl-...`, the `id` of every chunk and
answer), so that vLLM's `POST /abort_requests` can end them by id. Touched only on the server's event loop."""

from __future__ import annotations

from rollout.service.http.api.answers import Answer


class LiveAnswers:
    """Answers from the moment their groups were added until their last byte was sent (or their client left)."""

    def __init__(self) -> None:
        self._answers: dict[str, Answer] = {}

    def add(self, answer: Answer) -> None:
        """An answer's groups are on the engine."""
        self._answers[answer.id] = answer

    def remove(self, answer: Answer) -> None:
        """An answer ended."""
        self._answers.pop(answer.id, None)

    def cancel(self, ids: list[str]) -> list[str]:
        """Cancel the requests of these ids (their samples end with finish_reason "abort"); returns the ids found."""
        found = []
        for answer_id in dict.fromkeys(ids):
            answer = self._answers.get(answer_id)
            if answer is not None:
                answer.submission.cancel()
                found.append(answer_id)
        return found
