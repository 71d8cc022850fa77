from kiln.llm.detokenizer import IncrementalDetokenizer
from kiln.llm.sampling import SamplingParams

TEXT = "Grüße, 世界! naïve café 🙂 done. STOP here"


def stream(tok, text, **kw):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [], SamplingParams(**kw))
    pieces = []
    for i in ids:
        pieces.append(d.add(i))
        if d.stopped_by:
            break
    pieces.append(d.flush())
    return pieces, d


def test_stream_concatenates_to_the_decoded_text(smollm2_tokenizer):
    tok = smollm2_tokenizer
    # byte-level BPE splits some characters over several tokens; no piece may hold half of one
    assert any(tok.decode([i]).endswith("\ufffd") for i in tok.encode(TEXT))
    pieces, _ = stream(tok, TEXT)
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_is_cut_and_never_shown_in_part(smollm2_tokenizer):
    pieces, d = stream(smollm2_tokenizer, TEXT, stop=["STOP"])
    assert "".join(pieces) == TEXT[:TEXT.index("STOP")]
    assert d.stopped_by == "STOP"  # and since pieces only append, no part of it was shown


def test_stop_string_spanning_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    stop = "é 🙂 do"  # several tokens, starts mid-word
    assert len(tok.encode(stop)) > 2
    pieces, d = stream(tok, TEXT, stop=[stop, "never"])
    assert "".join(pieces) == TEXT[:TEXT.index(stop)]
    pieces, _ = stream(tok, TEXT, stop=[stop], include_stop_str_in_output=True)
    assert "".join(pieces) == TEXT[:TEXT.index(stop) + len(stop)]


def test_held_text_is_released_at_the_end(smollm2_tokenizer):
    pieces, d = stream(smollm2_tokenizer, "abc xyz", stop=["xyz!"])
    assert "".join(pieces) == "abc xyz" and d.stopped_by is None
