"""`ddpctl web`: a web view of the daemon served by the user's own ddpctl on 127.0.0.1.

It reads everything through the control socket as the user who runs it (the async client), so it
shows what that user may see. `command` is the click command; `server` binds the loopback port,
makes the token and runs the ASGI app (`app`, Starlette on hypercorn); `door` admits connections
by their peer's uid (a share per uid, a reserve for the owner and root); `opener` hands `--open`'s
browser a private file that redirects to the URL; `guard` refuses any request without the token
or with a Host that is not the bound address; `hub` fans the daemon's event
stream out to the open pages; `data` asks the daemon, `present` turns its answers into rows and
JSON, `chart` draws the loss curve as SVG, `sse` writes server-sent events. Templates and the
page's script and style are served from this package (templates/, static/); nothing from outside.
"""
