"""The Ray Serve applications of asyncrl, one module each: `train` (the running system and its
status), `policy` (OpenAI-compatible completions from the latest weights) and `reward` (one
application per reward endpoint, redeployable while training runs); `guards` holds what they share.
`configs/serve.yaml` deploys them together."""
