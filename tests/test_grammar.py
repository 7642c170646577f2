"""engine/grammar.py's guard rails: a JSON schema no finite value satisfies is refused when it is compiled (one
line saying so), and no error carries the grammar engine's internal state."""
import pytest

from pymoe.engine.grammar import Grammar, admits_a_value
from pymoe.errors import PymoeError

NODE = {"type": "object", "properties": {"next": {"$ref": "#"}}}


@pytest.mark.parametrize("schema, admits", [
    ({"type": "object"}, True),
    (NODE, True),  # {} : next is optional
    ({**NODE, "required": ["next"]}, False),  # every value holds another: no finite one
    ({"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
      "$ref": "#/$defs/a"}, False),  # two definitions requiring each other
    ({"$defs": {"a": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}},
                                                    "required": ["a"]}]}}, "$ref": "#/$defs/a"}, True),  # null ends it
    ({"type": "array", "items": {"$ref": "#"}}, True),  # []
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, False),  # [[[...]]]
    ({"type": ["object", "null"], "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, True),  # null
    ({"type": "object", "properties": {"x": False}, "required": ["x"]}, False),
    ({"allOf": [{"$ref": "#/definitions/t"}], "definitions": {"t": {"type": "string"}}}, True),
    ({"$ref": "#/definitions/missing"}, True),  # a dangling $ref is the compiler's to refuse
])
def test_admits_a_value(schema, admits):
    assert admits_a_value(schema) is admits


def test_a_schema_with_no_finite_value_is_refused_in_one_line():
    with pytest.raises(PymoeError) as e:
        Grammar.from_request("json_schema", {**NODE, "required": ["next"]})
    assert "admits no value" in str(e.value) and "\n" not in str(e.value)


def test_a_refused_token_says_so_without_the_engine_state(tiny_model):
    """The mask never offers such a token; were one fed anyway (or the engine to give up), the error is one line."""
    import pymoe

    tok = pymoe.load(tiny_model("qwen3moe", "f32"), n_ctx=64).tokenizer
    c = Grammar.from_request("gbnf", 'root ::= "yes"').constraint(tok)
    outside = int((~c.allowed()).nonzero()[0][0])
    with pytest.raises(PymoeError) as e:
        c.accept(outside)
    msg = str(e.value)
    assert msg.startswith("the gbnf grammar stopped at token") and "\n" not in msg and "<state>" not in msg
