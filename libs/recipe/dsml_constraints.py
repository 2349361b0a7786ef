"""DSML tool calls as a STRUCTURE constraint (libs/grammar/structure.py): the call block exactly as
dsml.py renders it, its ``｜DSML｜`` markup as the special token (by id), each parameter's value per
its tool's schema. Pure.

The three cases mirror the hermes ones in constraints.py:
- forced (tool_choice required or named): the prompt ends inside the opened block, so the output
  is one or more invokes and the block's close;
- strict tools under auto: free text, and a block the model opens (its DSML token) must follow the
  tools: a strict tool's parameters per its schema, another's any parameters;
- a response format beside tools under auto: the answer in the format, or a blank line and a block.

A parameter follows its schema in the form the renderer writes it: a string as raw text
(``string="true"``: its listed values, pattern or lengths, else any text), anything else as JSON
(``string="false"``); a schema that admits both gets both. Declared parameters come in their
declared order, required ones always. A raw string may contain any text but the DSML token; the
parser would also end it at the same markup spelled from ordinary tokens, which no grammar here
rules out (no model writes the fullwidth bars of ``｜DSML｜`` as plain text).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from libs.recipe.conversation import RecipeError, ToolDefinition
from libs.recipe.dsml import DSML, Dialect, Piece, tag_pieces
from libs.recipe.dsml_values import admits_only_strings, raw_string_schema

Node = dict[str, Any]  # one node of the structure spec
_ANY_PARAM_NAME = '[^"\\n]+'
_PARAM_NAME = re.compile(_ANY_PARAM_NAME)
_NO_MARKUP = [DSML]  # free text and raw strings never hold the markup, in any spelling


class DsmlGrammar:
    """Builds structure trees for one dialect; ``markup_ids`` maps a special token's spelling to
    its id (a spelling the vocabulary lacks as a special token stays literal text)."""

    def __init__(self, dialect: Dialect, markup_ids: Mapping[str, int]) -> None:
        self.dialect = dialect
        self.markup_ids = markup_ids

    def forced(self, tools: Sequence[ToolDefinition]) -> Node:
        """After the prefilled block opening: invokes (schemas followed), then the close."""
        return _seq(self._invokes(tools, follow=[True] * len(tools)), *self._tag("</", self.dialect.calls))

    def triggered(self, tools: Sequence[ToolDefinition]) -> Node:
        """Free text; the DSML token opens a block whose strict tools follow their schemas."""
        opening = self._tag("<", self.dialect.calls)  # "<", the DSML token, " calls>"
        trigger = next((i for i, node in enumerate(opening) if "token" in node), None)
        if trigger is not None:
            then = _seq(*opening[trigger + 1 :], {"lit": "\n"}, *self._block_rest(tools))
            return {"after": opening[trigger], "then": then, "excludes": _NO_MARKUP}
        # No DSML token: the whole opening is the (literal) trigger.
        then = _seq({"lit": "\n"}, *self._block_rest(tools))
        return {"after": _seq(*opening), "then": then, "excludes": _NO_MARKUP}

    def call_or_format(self, tools: Sequence[ToolDefinition], fmt: Node) -> Node:
        """The formatted answer, or a blank line and a block (as the renderer writes a call turn)."""
        opening = self._tag("<", self.dialect.calls)
        block = _seq({"lit": "\n\n"}, *opening, {"lit": "\n"}, *self._block_rest(tools))
        return {"or": [fmt, block]}

    # ---- pieces ------------------------------------------------------------------------------------

    def _block_rest(self, tools: Sequence[ToolDefinition]) -> list[Node]:
        follow = [bool(t.strict) for t in tools]
        return [self._invokes(tools, follow), *self._tag("</", self.dialect.calls)]

    def _invokes(self, tools: Sequence[ToolDefinition], follow: Sequence[bool]) -> Node:
        invokes = [self._invoke(tool, f) for tool, f in zip(tools, follow, strict=True)]
        one = invokes[0] if len(invokes) == 1 else {"or": invokes}
        return {"plus": _seq(one, {"lit": "\n"})}

    def _invoke(self, tool: ToolDefinition, follow: bool) -> Node:
        d = self.dialect
        params = self._params(tool.parameters) if follow else self._any_params()
        return _seq(
            *self._tag("<", d.invoke, f' name="{tool.name}"'),
            {"lit": "\n"},
            *params,
            *self._tag("</", d.invoke),
        )

    def _params(self, schema: Any) -> list[Node]:
        """Declared parameters in order (each followed by a newline), required ones always."""
        if not isinstance(schema, dict) or not isinstance(schema.get("properties"), dict):
            return self._any_params()
        defs = {key: schema[key] for key in ("$defs", "definitions") if key in schema}
        required = schema.get("required") or []
        if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
            raise RecipeError("a tool's parameters.required must be a list of names", param="tools")
        chain: list[Node] = []
        for name, sub in schema["properties"].items():
            if not _PARAM_NAME.fullmatch(name) or DSML in name:
                raise RecipeError(
                    f"DSML cannot name the parameter {name!r} (quotes, newlines and markup are not allowed)",
                    param="tools",
                )
            param = _seq(self._param(name, sub, defs), {"lit": "\n"})
            chain.append(param if name in required else {"opt": param})
        if self.dialect.empty_invoke_blank_line and not required:
            chain.append({"opt": {"lit": "\n"}})  # V4.1 writes a blank line in an empty invoke
        return chain

    def _any_params(self) -> list[Node]:
        d = self.dialect
        opening = self._open_parameter({"regex": _ANY_PARAM_NAME})
        value = {
            "or": [
                _seq({"lit": '" string="true">'}, {"text": True, "excludes": _NO_MARKUP}),
                _seq({"lit": '" string="false">'}, {"json": {}}),
            ]
        }
        one = _seq(*opening, value, *self._tag("</", d.parameter), {"lit": "\n"})
        if self.dialect.empty_invoke_blank_line:
            return [{"or": [{"lit": "\n"}, {"plus": one}]}]
        return [{"star": one}]

    def _open_parameter(self, name: Node) -> list[Node]:
        """``<``, the DSML token, `` parameter name="``, then ``name`` (the quote is the value's)."""
        opening = self._tag("<", self.dialect.parameter, ' name="')
        last = opening[-1]
        assert last.get("lit", "").endswith(">")
        return [*opening[:-1], {"lit": last["lit"][:-1]}, name]

    def _param(self, name: str, schema: Any, defs: Mapping[str, Any]) -> Node:
        d = self.dialect
        close = self._tag("</", d.parameter)
        forms: list[Node] = []
        string_schema = raw_string_schema(schema, defs)
        if string_schema is not None:
            opening = self._tag("<", d.parameter, f' name="{name}" string="true"')
            forms.append(_seq(*opening, {"string": string_schema, "excludes": _NO_MARKUP}, *close))
        if not admits_only_strings(schema, defs):
            opening = self._tag("<", d.parameter, f' name="{name}" string="false"')
            value = {**schema, **defs} if isinstance(schema, dict) else schema
            forms.append(_seq(*opening, {"json": value}, *close))
        return forms[0] if len(forms) == 1 else {"or": forms}

    def _tag(self, open_or_close: str, name: str, attributes: str = "") -> list[Node]:
        return self._nodes(tag_pieces(open_or_close, name, attributes))

    def _nodes(self, pieces: Sequence[Piece]) -> list[Node]:
        nodes: list[Node] = []
        for text, special in pieces:
            if special and text in self.markup_ids:
                nodes.append({"token": self.markup_ids[text]})
            elif nodes and "lit" in nodes[-1]:
                nodes[-1] = {"lit": nodes[-1]["lit"] + text}
            else:
                nodes.append({"lit": text})
        return nodes


def _seq(*nodes: Node) -> Node:
    """A sequence, flattened, with adjacent literals joined."""
    items: list[Node] = []
    for node in nodes:
        for item in node["seq"] if set(node) == {"seq"} else [node]:
            if items and set(items[-1]) == {"lit"} and set(item) == {"lit"}:
                items[-1] = {"lit": items[-1]["lit"] + item["lit"]}
            else:
                items.append(item)
    return items[0] if len(items) == 1 else {"seq": items}
