"""Every listed implementation imports and has its protocol's methods."""

import pytest

from agent.cluster import IMPLEMENTATIONS, implementation

METHODS = {"registry": ("register", "pass_ttl", "deregister", "healthy"),
           "scaler": ("set_target", "target")}


@pytest.mark.parametrize("kind,name", [(k, n) for k, v in IMPLEMENTATIONS.items() for n in v])
def test_listed_implementations_satisfy_their_protocol(kind, name):
    cls = implementation(kind, name)
    for method in METHODS[kind]:
        assert callable(getattr(cls, method)), (cls, method)


def test_unknown_implementation_names_the_choices():
    with pytest.raises(KeyError) as err:
        implementation("scaler", "k8s")
    assert "local" in str(err.value) and "nomad" in str(err.value)
