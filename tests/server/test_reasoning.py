"""The deepseek_r1 reasoning parser on synthetic outputs, whole and streamed in every split."""
import pytest

from latentserve.assets import DEFAULT_MODEL_DIR
from latentserve.engine.detokenizer import load_tokenizer
from latentserve.engine.reasoning import get_reasoning_parser

TOKENIZER = load_tokenizer(DEFAULT_MODEL_DIR)
PARSER = get_reasoning_parser("deepseek_r1")(TOKENIZER)

CASES = [
    ("<think>Let me see.</think>The answer.", "Let me see.", "The answer."),
    ("Let me see.</think>The answer.", "Let me see.", "The answer."),  # <think> was in the prompt
    ("Still thinking <th", "Still thinking <th", None),  # no end: all reasoning
    ("</think>Only an answer", None, "Only an answer"),
    ("<think>a</think>", "a", None),
    ("<think>x < y and </thin is not an end</think>{\"a\": 1}</think>", "x < y and </thin is not an end",
     "{\"a\": 1}</think>"),
]


@pytest.mark.parametrize("text, reasoning, content", CASES)
def test_whole_output(text, reasoning, content):
    assert PARSER.extract_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize("text, reasoning, content", CASES)
@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_streamed_deltas_reassemble(text, reasoning, content, step):
    got_reasoning, got_content, previous = "", "", ""
    cuts = list(range(step, len(text), step)) + [len(text)]
    for cut in cuts:
        r, c = PARSER.extract_reasoning_streaming(previous, text[:cut], finished=cut == len(text))
        assert "</think>" not in (r or "") and not (r or "").endswith("</")
        got_reasoning += r or ""
        got_content += c or ""
        previous = text[:cut]
    assert (got_reasoning or None, got_content or None) == (reasoning, content)


def test_unknown_parser_and_missing_token_are_named():
    with pytest.raises(ValueError, match="unknown reasoning parser 'qwen3'.*deepseek_r1"):
        get_reasoning_parser("qwen3")
    from tokenizers import Tokenizer, models
    from latentserve.engine.detokenizer import TokenizerInfo
    bare = TokenizerInfo(Tokenizer(models.BPE(vocab={"a": 0}, merges=[])))
    with pytest.raises(ValueError, match="has no '</think>' token"):
        get_reasoning_parser("deepseek_r1")(bare)


@pytest.fixture(scope="module")
def servers():
    from tests.server.conftest import LiveServer
    with_parser = LiveServer(DEFAULT_MODEL_DIR, reasoning_parser="deepseek_r1")
    plain = LiveServer(DEFAULT_MODEL_DIR)
    yield with_parser, plain
    with_parser.stop()
    plain.stop()


def _chat(server, stream: bool = False, **body):
    import openai
    from tests.server.conftest import MODEL_NAME
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    body = {"max_tokens": 40, **body}
    response = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Think."}],
                                              temperature=0, stream=stream, **body)
    if not stream:
        message = response.choices[0].message
        assert message.reasoning_content == message.reasoning
        return message.reasoning_content, message.content, response.choices[0].finish_reason
    reasoning, content, reason = "", "", None
    for chunk in response:
        for choice in chunk.choices:
            assert getattr(choice.delta, "reasoning_content", None) == getattr(choice.delta, "reasoning", None)
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return reasoning or None, content or None, reason


@pytest.mark.parametrize("stream", [False, True])
def test_end_to_end_the_answer_after_think_is_constrained(servers, stream):
    """`</think>` forced at once (logit bias): no reasoning; the answer after it follows the schema."""
    import json
    import jsonschema
    from tests.engine.structured.schemas import SCHEMAS
    end = TOKENIZER.tokenizer.token_to_id("</think>")
    with_parser, plain = servers
    body = dict(logit_bias={str(end): 100}, max_tokens=120,
                response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS[9]}})
    reasoning, content, reason = _chat(with_parser, stream, **body)
    assert reasoning is None and reason == "stop"
    jsonschema.validate(json.loads(content), SCHEMAS[9])
    # Without a reasoning parser the grammar constrains from the first token: </think> is never allowed.
    _, plain_content, _ = _chat(plain, stream, **body)
    assert "</think>" not in plain_content
    jsonschema.validate(json.loads(plain_content), SCHEMAS[9])


@pytest.mark.parametrize("bias", [None, 8.0])
def test_end_to_end_split_matches_the_raw_output(servers, bias):
    """The parser's reasoning + `</think>` + content is exactly what the model wrote; streamed equals whole."""
    with_parser, plain = servers
    end = TOKENIZER.tokenizer.token_to_id("</think>")
    body = {} if bias is None else dict(logit_bias={str(end): bias})
    raw = _chat(plain, **body)[1]
    whole = _chat(with_parser, **body)
    assert _chat(with_parser, True, **body) == whole
    reasoning, content, _ = whole
    if "</think>" in raw:
        assert (reasoning or "") + "</think>" + (content or "") == raw
    else:
        assert (reasoning, content) == (raw, None)
