"""`rollout-eval --chat` on rows in the SFT format, `messages` ending with the assistant's reply: the chat template
(with the generation prompt, as rollout-eval renders) writes that reply into the prompt before opening a new
assistant turn, so the model read the reference answer it was scored against, and the run said nothing. Such a row is
refused by name; a conversation ending with the user's turn is rendered as before. The reference: transformers'
`apply_chat_template`."""

from __future__ import annotations

import json

from rollout.eval.cli import main
from rollout.presets import tiny_tokenizer

QUESTION = {"role": "user", "content": "What is 2+2?"}
REPLY = {"role": "assistant", "content": "The answer is 4"}


def run(capsys, tmp_path, messages: list[dict]) -> tuple[int, str]:
    dataset = tmp_path / "chat.jsonl"
    dataset.write_text(json.dumps({"messages": messages, "answer": "4"}) + "\n")
    flags = ["--model", "tiny", "--dataset", dataset, "--prompt-field", "messages", "--answer-field", "answer"]
    status = main([*(str(flag) for flag in flags), "--chat", "--max-new-tokens", "2"])
    return status, capsys.readouterr().err


def test_messages_ending_with_the_reply_are_refused(capsys, tmp_path):
    rendered = tiny_tokenizer().apply_chat_template([QUESTION, REPLY], add_generation_prompt=True, tokenize=False)
    assert REPLY["content"] in rendered  # the prompt would hand the model its answer
    status, err = run(capsys, tmp_path, [QUESTION, REPLY])
    assert status == 2 and "Traceback" not in err
    assert (
        "rollout-eval: error: --prompt-field messages: row 0 ends with an assistant message, which the chat template "
        "would render into the prompt" in err
    )


def test_a_few_shot_conversation_ending_with_the_question_runs(capsys, tmp_path):
    status, err = run(capsys, tmp_path, [QUESTION, REPLY, {"role": "user", "content": "And 3+3?"}])
    assert status == 0, err


def test_a_user_or_system_message_without_content_is_a_missing_prompt(capsys, tmp_path):
    """A null content (how a converted dataset writes a missing question) renders as an empty turn: the model was
    asked nothing and scored anyway. Refused by name, as a missing text prompt is; an assistant turn that carried only
    tool calls (content null) is not the question and still runs."""
    rendered = tiny_tokenizer().apply_chat_template(
        [{"role": "user", "content": None}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"  # the question is gone
    for messages, where in (
        ([{"role": "user", "content": None}], "message 0 (user)"),
        ([{"role": "system", "content": float("nan")}, QUESTION], "message 0 (system)"),
    ):
        status, err = run(capsys, tmp_path, messages)
        assert status == 2 and "Traceback" not in err
        assert f"rollout-eval: error: --prompt-field messages: row 0 {where} has no content" in err, err
    status, err = run(capsys, tmp_path, [QUESTION, {"role": "assistant", "content": None}, QUESTION])
    assert status == 0, err


def test_a_row_the_chat_template_refuses_is_named(capsys, tmp_path):
    """A template that raises on a conversation it does not take (Mistral's and Llama 2's: "Conversation roles must
    alternate", on a system message) stopped the run with jinja's traceback; it is one line naming the row, with the
    template's own message (the reference: transformers' `apply_chat_template` raising it)."""
    import jinja2
    import pytest

    from rollout.presets import tiny_model

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endfor %}"
    )
    system = {"role": "system", "content": "Be brief."}
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        tokenizer.apply_chat_template([system, QUESTION], add_generation_prompt=True, tokenize=False)
    model_dir = tmp_path / "model"
    tiny_model().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    dataset = tmp_path / "chat.jsonl"
    dataset.write_text("".join(json.dumps({"messages": m}) + "\n" for m in ([QUESTION], [system, QUESTION])))
    flags = ["--model", model_dir, "--dataset", dataset, "--prompt-field", "messages", "--chat", "--device", "cpu"]
    status = main([*(str(flag) for flag in flags), "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err
    assert (
        "rollout-eval: error: --prompt-field messages: row 1: the tokenizer's chat template refused its messages "
        "(Conversation roles must alternate user/assistant/user/assistant/...)" in err
    ), err
