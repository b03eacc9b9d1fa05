"""Token ids of an episode's pieces: the prompt, the model's turns and the observations between them.

A conversation is tokenized piecewise, so that the model's own tokens are kept exactly as generated:
`prompt_ids` (the prompt messages and the generation prompt), then per round the model's turn (ending with
its stop token) and `observation_ids`: everything from after that stop token to the start of the next
model turn, generation prompt included. With a chat template (`TemplateChat`) the pieces together equal
the template's rendering of the whole conversation, tokenized; without one (`PlainChat`) they follow the
plain format of docs/episodes.md. `parse_turn` reads a model turn: Hermes `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` blocks become tool calls (a malformed one a call with an `error`, which
the environment answers; never an exception), the rest is the content. `turn_ids` renders an assistant
message as the model would emit it (SFT transcripts).

The tokenizer is a Hugging Face tokenizer, duck-typed: nothing is imported here, so april/ stays free of
transformers. Knows nothing about samples, engines or environments' logic.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from april.episode import Message, Role, Tool, ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
_MARKER = "april-turn-marker-7f3a"  # content of the stand-in assistant turn observations are rendered after
_PROBE_USER = Message(Role.USER, "hi")


class ChatError(Exception):
    """The tokenizer's chat template cannot be split into turns and observations; one line."""


def parse_turn(text: str) -> Message:
    """The assistant message in a model turn's text (its stop token already removed). Calls get the ids
    `call_0`, `call_1`, ... in order, so parsing is a pure function of the text."""
    calls: list[ToolCall] = []
    pieces: list[str] = []
    pos = 0
    for match in _CALL.finditer(text):
        pieces.append(text[pos : match.start()])
        calls.append(_parse_call(f"call_{len(calls)}", match.group(1)))
        pos = match.end()
    rest = text[pos:]
    if (open_at := rest.find(TOOL_CALL_OPEN)) != -1:
        calls.append(ToolCall(f"call_{len(calls)}", "", {}, f"{TOOL_CALL_OPEN} without {TOOL_CALL_CLOSE}"))
        rest = rest[:open_at]
    return Message(Role.ASSISTANT, ("".join(pieces) + rest).strip(), tuple(calls))


def _parse_call(call_id: str, body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except ValueError as exc:
        detail = f" ({exc.msg} at column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        return ToolCall(call_id, "", {}, f"tool call is not valid JSON{detail}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall(call_id, "", {}, 'tool call has no "name" string')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models emit the OpenAI API's JSON-string form
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    if not isinstance(arguments, dict):
        return ToolCall(call_id, obj["name"], {}, f'tool call {obj["name"]!r}: "arguments" is not an object')
    return ToolCall(call_id, obj["name"], arguments)


class ChatFormat:
    """The pieces of a conversation as token ids; `TemplateChat` and `PlainChat` render the text."""

    def __init__(self, tokenizer: Any, stop_ids: Sequence[int] | None = None) -> None:
        self.tok = tokenizer
        if stop_ids is None:
            eos = tokenizer.eos_token_id
            stop_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        self.stop_ids = tuple(int(i) for i in stop_ids)
        if not self.stop_ids:
            raise ChatError("chat: the tokenizer has no eos token and no stop ids were given")
        self.stop_texts = tuple(self._decode([i]) for i in self.stop_ids)

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[Tool] = ()) -> list[int]:
        """The prompt and the generation prompt: what the model's first turn follows."""
        raise NotImplementedError

    def turn_ids(self, turn: Message) -> list[int]:
        """An assistant message as the model emits it, its stop token included."""
        raise NotImplementedError

    def observation_ids(self, messages: Sequence[Message], *, after_stop: bool = True) -> list[int]:
        """The tokens between a model turn and the next one: after the turn's stop token, the observation
        messages and the generation prompt. `after_stop=False` for a turn cut off before its stop token
        (a per-turn budget ran out): the stop token is then the observation's first token."""
        raise NotImplementedError

    def turn_text(self, ids: Sequence[int]) -> str:
        """The text of a model turn's tokens for `parse_turn`: trailing stop tokens dropped, other special
        tokens kept (some models' tool-call markers are special)."""
        end = len(ids)
        while end and int(ids[end - 1]) in self.stop_ids:
            end -= 1
        return self._decode(ids[:end])

    def parse_turn(self, text: str) -> Message:
        return parse_turn(text)

    def _encode(self, text: str, special: bool = False) -> list[int]:
        return [int(i) for i in self.tok(text, add_special_tokens=special)["input_ids"]]

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))


class TemplateChat(ChatFormat):
    """The tokenizer's own chat template. A model turn ends at the first stop token (the tokenizer's eos,
    e.g. Qwen's `<|im_end|>`) after its content; what the template writes after it belongs to the next
    observation."""

    def __init__(
        self,
        tokenizer: Any,
        stop_ids: Sequence[int] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(tokenizer, stop_ids)
        self.template_kwargs = dict(template_kwargs or {})  # e.g. Qwen3's enable_thinking
        probe = Message(Role.ASSISTANT, _MARKER)
        head = self._render([_PROBE_USER], generation=True)
        whole = self._render([_PROBE_USER, probe], generation=False)
        if not whole.startswith(head):
            raise ChatError(
                "chat template: the prompt rendered with the generation prompt is not the start of the same "
                "prompt followed by an assistant turn, so turns cannot be appended to it token by token"
            )
        self._turn_end(whole, whole.index(_MARKER, len(head)))

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[Tool] = ()) -> list[int]:
        return self._encode(self._render(messages, generation=True, tools=tools))

    def turn_ids(self, turn: Message) -> list[int]:
        head = self._render([_PROBE_USER], generation=True)
        whole = self._render([_PROBE_USER, turn], generation=False)
        if not whole.startswith(head):
            raise ChatError("chat template: an assistant turn does not extend the prompt it follows")
        return self._encode(whole[len(head) : self._turn_end(whole, len(head))])

    def observation_ids(self, messages: Sequence[Message], *, after_stop: bool = True) -> list[int]:
        # The observation is rendered after a stand-in assistant turn that made the calls it answers (some
        # templates check that tool messages follow their calls); only what follows its stop token is kept.
        calls = tuple(ToolCall(m.tool_call_id, m.name) for m in messages if m.role == Role.TOOL)
        probe = Message(Role.ASSISTANT, _MARKER, calls)
        whole = self._render([_PROBE_USER, probe, *messages], generation=True)
        ids = self._encode(whole[self._turn_end(whole, whole.index(_MARKER)) :])
        return ids if after_stop else [self.stop_ids[0], *ids]

    def _turn_end(self, text: str, start: int) -> int:
        """The end of the first stop token's text in `text` at or after `start`."""
        ends = [i + len(s) for s in self.stop_texts if (i := text.find(s, start)) != -1]
        if not ends:
            raise ChatError(
                f"chat template: no stop token ({', '.join(map(repr, self.stop_texts))}) after an assistant "
                "turn; give the model's end-of-turn token as its stop id"
            )
        return min(ends)

    def _render(self, messages: Sequence[Message], *, generation: bool, tools: Sequence[Tool] = ()) -> str:
        return str(
            self.tok.apply_chat_template(
                [m.to_openai() for m in messages],
                tools=[t.to_openai() for t in tools] or None,
                add_generation_prompt=generation,
                tokenize=False,
                **self.template_kwargs,
            )
        )


class PlainChat(ChatFormat):
    """The plain format, for tokenizers without a chat template (docs/episodes.md): system, user and tool
    text each end with a newline, a tool result is wrapped in `<tool_response>` tags, a model turn is its
    content followed by compact `<tool_call>` JSON blocks and the stop token, and there are no role
    markers and no generation prompt. Tools are not described in the prompt: the environment's prompt
    text, or training, tells the model about them. Each piece is tokenized on its own."""

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[Tool] = ()) -> list[int]:
        del tools
        return self._encode("".join(self._message_text(m) for m in messages), special=True)

    def turn_ids(self, turn: Message) -> list[int]:
        return self._encode(self._message_text(turn))

    def observation_ids(self, messages: Sequence[Message], *, after_stop: bool = True) -> list[int]:
        ids = self._encode("".join(self._message_text(m) for m in messages))
        return ids if after_stop else [self.stop_ids[0], *ids]

    def _message_text(self, message: Message) -> str:
        if message.role == Role.ASSISTANT:
            calls = "".join(
                TOOL_CALL_OPEN
                + json.dumps({"name": c.name, "arguments": dict(c.arguments)}, separators=(",", ":"))
                + TOOL_CALL_CLOSE
                for c in message.tool_calls
            )
            return message.content + calls + self.stop_texts[0]
        if message.role == Role.TOOL:
            return TOOL_RESPONSE_OPEN + message.content + TOOL_RESPONSE_CLOSE + "\n"
        return message.content + "\n"


def chat_format(
    tokenizer: Any, stop_ids: Sequence[int] | None = None, template_kwargs: Mapping[str, Any] | None = None
) -> ChatFormat:
    """The tokenizer's chat template if it has one (rendered with `template_kwargs`), else the plain
    format. `stop_ids` default to the tokenizer's eos."""
    if getattr(tokenizer, "chat_template", None):
        return TemplateChat(tokenizer, stop_ids, template_kwargs)
    return PlainChat(tokenizer, stop_ids)
