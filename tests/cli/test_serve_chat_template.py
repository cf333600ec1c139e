"""engine/chat_template.py renders exactly what transformers' chat-template renderer renders.

The references are transformers' own ``render_jinja_template`` (the function
behind ``apply_chat_template``) on the same template text; the server-level
check (prompt ids equal ``AutoTokenizer.apply_chat_template`` on the SmolLM2
directory) is in test_serve_openai.py.
"""

from __future__ import annotations

import json

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from tierkv.engine.chat_template import ChatTemplate, ChatTemplateError, end_of_turn_ids

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama-3 style: bos_token, trim_blocks/lstrip_blocks-sensitive block tags, raise_exception, loop controls, tojson.
LLAMA3 = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('roles must be system, user or assistant') }}
    {% endif %}
    {% if loop.index0 > 40 %}{% break %}{% endif %}
    {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
    {% if message.name is defined %}{{ message.name | tojson }}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
    {{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{% else %}
    {{ eos_token }}
{% endif %}"""
SPECIALS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "  Tell me a joke.  "}],
    [{"role": "user", "content": "Ünïcödé «quotes» <html> & 日本語", "name": "ed\"o"}],
    [{"role": "user", "content": ""}],
]


@pytest.mark.parametrize("source", [CHATML, LLAMA3], ids=["chatml", "llama3"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_render_equals_transformers(source, add_generation_prompt, conversation):
    messages = CONVERSATIONS[conversation]
    ours = ChatTemplate(source, SPECIALS).render(messages, add_generation_prompt)
    theirs = render_jinja_template([messages], chat_template=source, add_generation_prompt=add_generation_prompt,
                                   **SPECIALS)[0][0]
    assert ours == theirs


def test_text_parts_are_joined_like_a_string_content():
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    joined = [{"role": "user", "content": "one\ntwo"}]
    template = ChatTemplate(CHATML)
    assert template.render(parts) == template.render(joined)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\].*'image_url'"):
        template.render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_raise_exception_and_a_broken_template_are_errors():
    with pytest.raises(ChatTemplateError, match="roles must be system, user or assistant"):
        ChatTemplate(LLAMA3, SPECIALS).render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="not a valid jinja2 template"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute escapes
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([{"role": "user", "content": "x"}])


def test_from_model_dir_reads_where_transformers_reads(tmp_path):
    assert ChatTemplate.from_model_dir(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": CHATML}],
        "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "<|im_end|>"}))
    t = ChatTemplate.from_model_dir(tmp_path)
    assert t.source == CHATML and t.special_tokens == {"bos_token": "<s>", "eos_token": "<|im_end|>"}
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}jinja file")
    assert ChatTemplate.from_model_dir(tmp_path).render([]) == "<s>jinja file"
    assert ChatTemplate.from_model_dir(tmp_path, override="{{ eos_token }}!").render([]) == "<|im_end|>!"
    override = tmp_path / "mine.jinja"
    override.write_text("from a file")
    assert ChatTemplate.from_model_dir(tmp_path, override=str(override)).render([]) == "from a file"


def test_end_of_turn_ids_come_from_generation_config_and_the_eos_token(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert end_of_turn_ids(tmp_path, {"<|im_end|>": 9}.get) == (0, 2, 7, 9)
    assert end_of_turn_ids(tmp_path, lambda t: None) == (0, 2, 7)
