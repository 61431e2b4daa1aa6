import pytest

from agent.errors import ConfigError, Unauthorized
from agent.frontdoor.auth import TokenAuth


def test_token_file_maps_tenants_and_checks_every_secret(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# tenants\nacme:" + "a" * 16 + "\n\nglobex:" + "g" * 24 + "\n")
    auth = TokenAuth.from_file(path)
    assert auth.enabled
    assert auth.check("a" * 16) == "acme" and auth.check("g" * 24) == "globex"
    for bad in (None, "", "a" * 15, "a" * 17, "g" * 24 + " "):
        with pytest.raises(Unauthorized) as err:
            auth.check(bad)
        assert err.value.code == 401


def test_malformed_token_file_names_the_line(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("acme:" + "a" * 16 + "\nno-colon-here\n")
    with pytest.raises(ConfigError, match=":2:"):
        TokenAuth.from_file(path)


def test_without_tokens_everything_passes():
    assert TokenAuth().check(None) is None and not TokenAuth().enabled
