"""Chat templates on the router's OpenAI-compatible HTTP: where the template comes from (``chat_template.jinja``,
``tokenizer_config.json``'s string or list of named templates), ``bos_token`` / ``eos_token`` as Hugging Face
passes them, ``raise_exception`` and a model without a template answered with a 400 in OpenAI's shape.

Each case starts a real router (real Redis, real sockets; no engines: what the HTTP layer hands to the router
core is captured instead of generated) on a copy of the tiny model with its own tokenizer files.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from proto.eyrie.v1 import eyrie_pb2 as pb
from services.router.openai_http import ChatTemplate
from services.router.server import start_router
from services.settings import RouterSettings
from shared.model.tokenizer import BOS, EOS, Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
# Llama-3-like: bos once at the start, every turn closed by eos.
TURNS = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def expected(messages=MESSAGES, bos=BOS, eos=EOS) -> str:
    return bos + "".join(f"<|{m['role']}|>\n{m['content']}{eos}" for m in messages) + "<|assistant|>\n"


@pytest.fixture
def model_dir(tiny_model_dir, tmp_path):
    """The tiny target's config and tokenizer, with no chat template yet (each test writes its own)."""
    out = tmp_path / "model"
    out.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny_model_dir / "target" / name, out / name)
    return out


def write_config(model_dir, **fields) -> None:
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS, **fields}))


@pytest.fixture
def serve(redis_url):
    """start(model_dir) -> (base URL, the GenerateRequests the router core was given)."""
    handles = []

    def start(model_dir):
        handle = start_router(RouterSettings(model=str(model_dir), redis_url=redis_url, openai_port=0,
                                             placement_timeout_s=0.2))
        handles.append(handle)
        seen: list[pb.GenerateRequest] = []

        async def stream(req, deliver=None):  # instead of placing it on engines: one token, finished
            seen.append(req)
            yield pb.GenerateResponse(request_id=req.request_id, token_ids=[7], text="x",
                                      finish=pb.Finish(reason="length", usage=pb.Usage(prompt_tokens=1,
                                                                                       completion_tokens=1)))

        handle.extra["core"].stream = stream
        return f"http://{handle.extra['openai_address']}", seen

    yield start
    for h in handles:
        h.stop(0)


def chat(base: str, messages=MESSAGES) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", json={"model": "eyrie", "messages": messages, "max_tokens": 1},
                      timeout=30)


def test_bos_and_eos_tokens_reach_the_template_and_tokenize_as_themselves(model_dir, serve):
    write_config(model_dir, chat_template=TURNS)
    base, seen = serve(model_dir)
    r = chat(base)
    assert r.status_code == 200, r.text
    assert seen[0].text == expected()
    tok = Tokenizer(model_dir)
    ids = tok.encode(seen[0].text)
    bos, eos = tok.token_id(BOS), tok.token_id(EOS)
    assert ids[0] == bos and ids.count(bos) == 1  # the template's BOS, and no second one added by the router
    assert ids.count(eos) == len(MESSAGES)


def test_bos_and_eos_given_as_added_token_objects(model_dir, serve):
    write_config(model_dir, chat_template=TURNS, bos_token={"content": "<s>", "lstrip": False},
                 eos_token={"content": "</s>", "special": True})
    base, seen = serve(model_dir)
    assert chat(base).status_code == 200
    assert seen[0].text == expected(bos="<s>", eos="</s>")


def test_chat_template_jinja_file_is_used_and_wins_over_the_config(model_dir, serve):
    write_config(model_dir, chat_template="CONFIG {{ messages[0]['content'] }}")
    (model_dir / "chat_template.jinja").write_text(TURNS)
    base, seen = serve(model_dir)
    assert chat(base).status_code == 200
    assert seen[0].text == expected()


def test_chat_template_jinja_file_alone(model_dir, serve):
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                                                   "{% endfor %}[assistant] ")
    base, seen = serve(model_dir)  # no tokenizer_config.json at all: bos/eos are empty, the template works
    assert chat(base, MESSAGES[:2]).status_code == 200
    assert seen[0].text == "[system] Be brief.\n[user] hi\n[assistant] "


@pytest.mark.parametrize("named, want", [
    ([{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": TURNS}], expected()),
    ([{"name": "rag", "template": "RAG {{ messages | length }}"}, {"name": "tool_use", "template": "TOOLS"}],
     "RAG 4"),  # no "default": the first one
], ids=["default", "first"])
def test_list_of_named_templates_in_the_config(model_dir, serve, named, want):
    write_config(model_dir, chat_template=named)
    base, seen = serve(model_dir)
    assert chat(base).status_code == 200
    assert seen[0].text == want


def test_raise_exception_in_the_template_is_a_400_with_its_message(model_dir, serve):
    write_config(model_dir, chat_template=(
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported by this model') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"))
    base, seen = serve(model_dir)
    r = chat(base)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    assert "System role not supported by this model" in error["message"]
    assert seen == []  # nothing reached the router core
    assert chat(base, MESSAGES[1:2]).status_code == 200  # the same template takes what it accepts
    assert seen[0].text == "hi"


def test_a_model_without_a_chat_template_refuses_chat_naming_the_model(model_dir, serve):
    write_config(model_dir)  # bos/eos but no chat_template
    base, seen = serve(model_dir)
    r = chat(base)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "no_chat_template" and error["param"] == "messages"
    assert "'eyrie'" in error["message"] and "chat template" in error["message"]
    assert "/v1/completions" in error["message"]
    r = httpx.post(f"{base}/v1/completions", json={"model": "eyrie", "prompt": "hi", "max_tokens": 1}, timeout=30)
    assert r.status_code == 200 and seen[0].text == "hi"  # completions still work


def test_a_template_that_does_not_compile_is_a_clear_500(model_dir, serve):
    write_config(model_dir, chat_template="{% for m in messages %}{{ m['content'] }")
    base, _ = serve(model_dir)
    r = chat(base)
    assert r.status_code == 500 and r.json()["error"]["code"] == "bad_chat_template"
    assert "does not compile" in r.json()["error"]["message"]


def test_tojson_renders_like_hugging_face_and_the_sandbox_holds(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{{ messages | tojson }}")
    t = ChatTemplate(tmp_path)
    assert t.render([{"role": "user", "content": "a < b & 'c' é"}]) == \
        '[{"role": "user", "content": "a < b & \'c\' é"}]'  # no HTML escaping, no ASCII escaping
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception) as err:
        ChatTemplate(tmp_path).render([{"role": "user", "content": "x"}])
    assert getattr(err.value, "status", None) == 400  # the sandbox refuses, answered as a bad request
