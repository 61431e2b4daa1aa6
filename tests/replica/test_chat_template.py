"""The model's own chat template: rendered from tokenizer_config.json, refusals typed."""

import json

import pytest

from agent.errors import InvalidCheckpoint, ProtocolError
from agent.replica.tokenizer import ChatTemplate, chat_prompt, load_chat_template

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_renders_messages_with_the_generation_prompt(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "bos_token": "<s>", "eos_token": "</s>"}))
    tpl = load_chat_template(tmp_path)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tpl.render(msgs) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tpl.render(msgs, add_generation_prompt=False).endswith("Hi<|im_end|>\n")
    assert ChatTemplate("{{ bos_token }}|{{ eos_token }}", bos_token="<s>",
                        eos_token="</s>").render([]) == "<s>|</s>"


def test_no_template_and_bad_templates(tmp_path):
    assert load_chat_template(tmp_path) is None                      # no tokenizer_config.json
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": None}))
    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(InvalidCheckpoint, match="unreadable"):
        load_chat_template(tmp_path)
    with pytest.raises(InvalidCheckpoint) as err:
        ChatTemplate("{% for %}")
    assert err.value.field == "chat_template"


def test_a_template_refusal_is_a_400_and_the_sandbox_holds():
    tpl = ChatTemplate("{% if messages[0]['role'] != 'user' %}"
                       "{{ raise_exception('first message must be from the user') }}{% endif %}ok")
    assert tpl.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ProtocolError) as err:
        tpl.render([{"role": "assistant", "content": "x"}])
    assert err.value.code == 400 and "first message must be from the user" in err.value.message
    with pytest.raises(ProtocolError):   # the sandbox refuses attribute games
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])


@pytest.mark.slow
def test_smollm2s_own_template_gives_its_chatml(smollm2_dir):
    tpl = load_chat_template(smollm2_dir)
    assert tpl.render([{"role": "user", "content": "Hi"}]) == chat_prompt("Hi")


@pytest.mark.parametrize("source", [
    "{{ 1 / 0 }}",                                   # ZeroDivisionError
    "{{ messages[0].content + 1 }}",                 # TypeError
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",  # RecursionError
])
def test_a_template_failing_with_a_python_error_is_a_400_naming_messages(source):
    from agent.errors import ProtocolError

    with pytest.raises(ProtocolError) as err:
        ChatTemplate(source).render([{"role": "user", "content": "x"}])
    assert err.value.field == "messages" and err.value.code == 400
