"""Structured outputs on the OpenAI routes: OpenAI's `response_format` and vLLM's extra fields (`guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`, and the newer `structured_outputs` object) → the engine's
constraint keyword arguments (`json_schema`, `json_object`, `regex`, `choice`, `grammar`: `mii.engine.constraints`).

Only the translation lives here: the constraint is compiled and checked once, by the replica, and a bad schema,
regex or grammar comes back as a 400 naming the field the request used (`response_format`, `guided_regex`, ...).
At most one constraint per request, and none together with a tool choice that constrains the output.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from mii.serving.http import APIError

CONSTRAINT_KEYS = ("json_schema", "json_object", "regex", "choice", "grammar")
"""The engine's constraint arguments (`mii.engine.constraints.KINDS`)."""


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class JSONObjectFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_object"]


class JSONSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: Optional[str] = None
    schema_: Optional[Union[dict[str, Any], bool]] = Field(
        None, alias="schema", description="a JSON schema; without one, any JSON object")
    strict: Optional[bool] = Field(None, description="accepted; the output always follows the schema")


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[Union[TextFormat, JSONObjectFormat, JSONSchemaFormat], Field(discriminator="type")]


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (one of its fields)."""

    model_config = ConfigDict(extra="forbid")
    json_: Optional[Union[dict[str, Any], bool, str]] = Field(None, alias="json", description="a JSON schema")
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = Field(None, description="GBNF or Lark")


class StructuredFields(BaseModel):
    """The request fields of this module, mixed into both OpenAI request bodies."""

    response_format: Optional[ResponseFormat] = None
    # vLLM's names
    guided_json: Optional[Union[dict[str, Any], bool, str]] = Field(None, description="a JSON schema (vLLM)")
    guided_regex: Optional[str] = Field(None, description="a regular expression the output matches (vLLM)")
    guided_choice: Optional[list[str]] = Field(None, description="the output is one of these strings (vLLM)")
    guided_grammar: Optional[str] = Field(None, description="a GBNF or Lark grammar (vLLM)")
    structured_outputs: Optional[StructuredOutputs] = None

    def constraint(self) -> tuple[dict, dict]:
        """(the engine's constraint keyword arguments, {engine field: this request's field} for error messages);
        a 400 naming the second field when two constraints are given."""
        given: list[tuple[str, str, Any]] = []  # (request field, engine key, value)
        rf = self.response_format
        if isinstance(rf, JSONObjectFormat):
            given.append(("response_format", "json_object", True))
        elif isinstance(rf, JSONSchemaFormat):
            schema = rf.json_schema.schema_
            given.append(("response_format", "json_object", True) if schema is None else
                         ("response_format", "json_schema", schema))
        for name, key in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given.append((name, key, getattr(self, name)))
        so = self.structured_outputs
        if so is not None:
            for attr, key in (("json_", "json_schema"), ("json_object", "json_object"), ("regex", "regex"),
                              ("choice", "choice"), ("grammar", "grammar")):
                value = getattr(so, attr)
                if value is not None and value is not False:
                    given.append(("structured_outputs", key, value))
        if len(given) > 1:
            raise APIError(400, f"{given[1][0]}: only one output constraint per request; "
                                f"{', '.join(g[0] for g in given)} were given", param=given[1][0])
        if not given:
            return {}, {}
        field, key, value = given[0]
        return {key: value}, {key: field}


def merge(kwargs: dict, extra: dict, field: str = "response_format") -> dict:
    """`kwargs` with `extra` (what tools add); a 400 when both constrain the output."""
    if any(k in kwargs for k in CONSTRAINT_KEYS) and any(k in extra for k in CONSTRAINT_KEYS):
        raise APIError(400, f"{field}: cannot be combined with a tool_choice that constrains the output "
                            "(\"required\" or a named function)", param=field)
    return {**kwargs, **extra}
