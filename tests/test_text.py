"""Tokenizer, chat template (sandboxed), incremental detokenization and stop strings."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from hypothesis import given, settings, strategies as st  # noqa: E402

from mooncake_rs.errors import InvalidArgument  # noqa: E402
from mooncake_rs.text import IncrementalDetokenizer, StopStrings, Tokenizer  # noqa: E402

import text_helpers as th  # noqa: E402


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    th.make_tokenizer().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": th.CHAT_TEMPLATE}))
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


def test_encode_decode_round_trip_non_ascii(tok):
    for line in th.CORPUS:
        ids = tok.encode(line)
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids) == line
        assert tok.encode(line, add_special_tokens=False) == ids[1:]
    assert tok.eos_token_id == tok.token_to_id("</s>")


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidArgument, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(InvalidArgument, match="could not be loaded"):
        Tokenizer.from_dir(tmp_path)


def test_chat_template_renders_and_encodes(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "héllo"}]}]
    text = tok.apply_chat_template(msgs)
    assert text == "<s><|system|>be brief<|end|><|user|>héllo<|end|><|assistant|>"
    ids = tok.encode_chat(msgs)
    assert ids.count(tok.bos_token_id) == 1  # the template's BOS, not doubled by the post-processor
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("<|assistant|>")


def test_chat_template_refusals_are_invalid_argument(tok):
    with pytest.raises(InvalidArgument, match="roles are system, user, assistant"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(InvalidArgument, match="messages"):
        tok.apply_chat_template([])
    with pytest.raises(InvalidArgument, match=r"content\[0\]"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


@pytest.mark.parametrize("src", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",       # reaching Python internals
    "{{ messages.append({'role': 'user'}) }}",               # mutating what it was given
    "{% set x = messages[0].update({'role': 'x'}) %}{{ x }}",
])
def test_chat_template_is_sandboxed(tmp_path, src):
    th.make_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": src}))
    t = Tokenizer.from_dir(tmp_path)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidArgument, match="unsafe"):
        t.apply_chat_template(msgs)
    assert msgs == [{"role": "user", "content": "hi"}]


def test_no_chat_template_is_a_clear_error(tmp_path):
    th.make_tokenizer().save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(InvalidArgument, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def _stream(tok, ids, context=()):
    d = IncrementalDetokenizer(tok, context=context)
    deltas = [d.push([t]) for t in ids]
    return deltas, d.flush()


def test_streamed_text_never_splits_a_character(tok):
    for line in th.CORPUS:
        ids = tok.encode(line, add_special_tokens=False)
        deltas, tail = _stream(tok, ids)
        assert all("\ufffd" not in x for x in deltas), deltas
        assert "".join(deltas) + tail == line
        assert tail == ""


def test_multibyte_character_split_across_tokens_waits_for_its_last_byte(tok):
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1, "the emoji must span several byte-level tokens for this test"
    deltas, tail = _stream(tok, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "😀" and tail == ""


def test_unfinished_character_comes_out_at_flush(tok):
    ids = tok.encode("a😀", add_special_tokens=False)[:-1]  # the emoji's last byte never comes
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) == "a"
    assert tail and set(tail) == {"\ufffd"}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(3, 319), min_size=1, max_size=80), st.integers(0, 5))
def test_stream_equals_whole_decode(tok, ids, ctx_len):
    """Any token sequence (random bytes too): the streamed text is the whole decode's."""
    context = ids[:ctx_len]
    body = ids[ctx_len:]
    deltas, tail = _stream(tok, body, context)
    whole = tok.decode(context + body)
    assert ("".join(deltas) + tail) == whole[len(tok.decode(context)):]
    assert all(not x.endswith("\ufffd") for x in deltas)


# ---- stop strings

def _run_stops(stops, pieces):
    s = StopStrings(stops)
    out = []
    for p in pieces:
        text, hit = s.feed(p)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + s.flush(), False


def _reference(stops, text):
    """The text up to the stop string completed first (ties: the one that began first)."""
    hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i != -1]
    return (text[:min(hits)[1]], True) if hits else (text, False)


def test_stop_string_spanning_deltas():
    assert _run_stops(["lo wo"], ["hel", "lo", " w", "orld"]) == ("hel", True)
    assert _run_stops(["xyz"], ["ab", "x", "y", "q"]) == ("abxyq", False)


def test_held_back_text_is_released_once_it_cannot_stop():
    s = StopStrings(["END"])
    assert s.feed("foo E") == ("foo ", False)   # "E" may begin END
    assert s.feed("N") == ("", False)
    assert s.feed("d") == ("ENd", False)        # it did not: released
    assert s.flush() == ""


def test_first_completed_stop_wins():
    assert _run_stops(["world", "lo"], ["hello world"]) == ("hel", True)
    # "é" completes before "aéa" does, in one delta or several
    assert _run_stops(["é", "aéa"], ["aaéa"]) == _run_stops(["é", "aéa"], ["aa", "é", "a"]) == ("aa", True)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abé😀 ", max_size=40), st.lists(st.text(alphabet="abé😀 ", min_size=1, max_size=4),
                                                         min_size=1, max_size=3), st.randoms())
def test_stop_strings_match_reference(text, stops, rnd):
    cuts = sorted(rnd.sample(range(len(text) + 1), min(len(text) + 1, rnd.randint(0, 8))))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    assert _run_stops(stops, pieces) == _reference(stops, text)


def test_bad_stop_strings_refused():
    with pytest.raises(InvalidArgument):
        StopStrings([""])


def test_random_ascii_stop_sanity():
    rng = random.Random(0)
    text = "".join(rng.choice("ab") for _ in range(200))
    pieces = [text[i:i + 3] for i in range(0, 200, 3)]
    assert _run_stops(["abba", "bbb"], pieces) == _reference(["abba", "bbb"], text)


def test_template_list_form_and_side_file(tmp_path):
    th.make_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": [
        {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "{{ messages[0].content }}!"}]}))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hé"}]) == "hé!"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "chat_template.jinja").write_text("[{{ messages | length }}]{{ messages | tojson }}")
    out = Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "ü<b>"}])
    assert out == '[1][{"role": "user", "content": "ü<b>"}]'  # tojson keeps the text as is
