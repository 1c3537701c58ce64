import pytest

from claas_verl.tiny import gym


@pytest.fixture(scope="module")
def tok():
    """The gym bundle's byte tokenizer (the stage proxy's tests build tiny models over it)."""
    return gym.byte_tokenizer()
