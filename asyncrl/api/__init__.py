"""The OpenAI-compatible surface of the policy endpoint, pure of Serve and of engines: the requests
(`requests`, pydantic models and what each field asks of an engine), tool calling through the chat
template (`tools`), one choice's text as its tokens arrive (`choices`) and the answers built from the
`openai` package's own types (`responses`). The Serve deployment that runs them is `asyncrl.serve.policy`.
May import the messages, the algorithms' sampling settings, the engines' interface and the
environments' tool formats; never a role, the run or Serve."""
