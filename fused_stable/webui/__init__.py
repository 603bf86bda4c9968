"""`fused-stable webui`: a live page over the runs of one workspace folder (gradio, the optional extra
`.[webui]`).

The page holds no state of its own that a refresh or a restart could lose: every run is a `fused-stable sft`
process of its own (`controller`, `runner`), and what the page shows is read back from the run's folder and
from small records the page keeps beside it in `WORKSPACE/.webui/` (`runs`, `records`). One run at a time
per workspace (`lock`); nothing outside the workspace is read or written through the page (`paths`). The
gradio page and its API endpoints are `page`; chat and export on a finished run go through the commands'
own code (`finished`).
"""
