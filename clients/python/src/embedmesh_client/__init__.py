"""embedmesh's Python gRPC client: raw tensor bytes in, completions, chat and embeddings out.

    from embedmesh_client import Client
    with Client("127.0.0.1:50051") as c:
        print(c.complete("SmolLM2-135M-Instruct", embeds=rows, max_tokens=12, temperature=0).choices[0].text)
"""

from embedmesh_client.client import AsyncClient, Client
from embedmesh_client.errors import EmbedmeshClientError
from embedmesh_client.tensors import from_tensor, to_tensor

__all__ = ["Client", "AsyncClient", "EmbedmeshClientError", "to_tensor", "from_tensor"]
