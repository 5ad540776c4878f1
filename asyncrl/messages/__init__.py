"""The messages that cross actor boundaries and how they travel: the msgspec Structs (`structs`),
their encoding with numpy arrays as raw bytes (`wire`), the routes of a mixture-of-experts model's
tokens (`routes`), bounded mailboxes with leases, acknowledgement and deduplication in one process
(`mailbox`) and across processes as a Ray actor (`ray_mailbox`). Definitions and plumbing only: imports nothing of asyncrl beyond this package."""
