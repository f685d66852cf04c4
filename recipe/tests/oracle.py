"""deepseek-recipe 0.2.0 (DeepSeek's own codec) as a test oracle. Tests that need it skip with a
reason when it is not installed; it is never a runtime dependency."""

import functools
import json

import pytest
from deepinfer_recipe.tokenize import deepseek_v4_tokenizer_path

try:
    import deepseek_recipe as dr
except ImportError:  # pragma: no cover - depends on the environment
    dr = None

needs_oracle = pytest.mark.skipif(dr is None, reason="deepseek-recipe (test oracle) is not installed")

_REQUESTS = {"chat": "ChatCompletionRequest", "responses": "ResponsesRequest", "messages": "MessagesRequest"}


def convert(protocol: str, body: dict):
    request_type = getattr(dr, _REQUESTS[protocol])
    return request_type(json.dumps(body)).convert(dr.ConversionOptions())


def is_v41(request) -> bool:
    return request.model_version != dr.ModelVersion.DeepseekV4Pro


def render(protocol: str, body: dict):
    """(prompt text, special ranges, token ids or None for V4.1) as the oracle produces them."""
    request = convert(protocol, body)
    if is_v41(request):
        rendered = dr.DeepseekV41Encoding().render_conversation(request.conversation)
        return rendered.prompt, [tuple(r) for r in rendered.special_ranges], None
    encoding = v4_encoding()
    rendered = encoding.render_conversation(request.conversation)
    return rendered.prompt, [tuple(r) for r in rendered.special_ranges], encoding.encode(request.conversation)


@functools.lru_cache(maxsize=1)
def v4_encoding():
    return dr.DeepseekV4Encoding().with_tokenizer(dr.Tokenizer.from_file(str(deepseek_v4_tokenizer_path())))
