"""SGLang as the rollout engine: the HTTP client (`client`), the server processes (`server`) and where they sit
(`servers`), the supervised engine (`engine`), the weight pushes (`weight_push`) and the wire formats (`protocol`)."""
