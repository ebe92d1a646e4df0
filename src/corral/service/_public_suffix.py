"""Is a name a public suffix (`com`, `co.uk`, `github.io`)? A secret bound to `*.<public suffix>` would go to
every site under it, so it is refused (docs/secrets.md).

Every single-label name is a top-level domain (or a local one such as `localhost`), and so a suffix anyone may
register under; a multi-label name is checked against a small built-in list of the suffixes most often mistaken
for a domain: the second-level suffixes of the largest country domains and the shared hosting domains that the
Public Suffix List (publicsuffix.org) lists as private suffixes.

Why not the full list through a library: neither `tldextract` nor `publicsuffix2` is a dependency, and neither
would be justified for one validation on a rare operator action. `tldextract` fetches the list over the network on
first use unless told otherwise (a server must not reach out when a secret is put), and `publicsuffix2` bundles a
snapshot that is years old. Missing a rare suffix here only lets an operator bind a secret more widely than
meant, which the operator decided anyway; the exact name, never a wildcard, is the safe binding.
"""

from __future__ import annotations

__all__ = ["is_public_suffix"]

_MULTI_LABEL = frozenset({
    # Second-level suffixes of country domains.
    "co.uk", "org.uk", "ac.uk", "gov.uk", "me.uk", "net.uk", "ltd.uk", "plc.uk", "com.au", "net.au", "org.au",
    "edu.au", "gov.au", "co.nz", "org.nz", "net.nz", "co.jp", "ne.jp", "or.jp", "ac.jp", "go.jp", "com.br",
    "net.br", "org.br", "gov.br", "com.cn", "net.cn", "org.cn", "gov.cn", "co.in", "net.in", "org.in", "gov.in",
    "co.za", "org.za", "com.mx", "org.mx", "gob.mx", "com.ar", "com.tr", "com.tw", "com.hk", "com.sg", "co.kr",
    "or.kr", "com.my", "co.id", "or.id", "com.ph", "com.vn", "co.il", "org.il", "com.ua", "com.pl", "co.th",
    "in.th", "com.eg", "com.sa", "com.pk", "com.ng", "co.ke", "com.co", "com.pe", "com.ve", "gov.us",
    # Shared hosting: every customer gets a subdomain (the Public Suffix List's private section).
    "github.io", "githubusercontent.com", "gitlab.io", "herokuapp.com", "vercel.app", "netlify.app", "pages.dev",
    "workers.dev", "appspot.com", "web.app", "firebaseapp.com", "blogspot.com", "cloudfront.net",
    "amazonaws.com", "s3.amazonaws.com", "elasticbeanstalk.com", "azurewebsites.net", "cloudapp.net",
    "azurestaticapps.net", "fly.dev", "onrender.com", "ngrok.io", "ngrok-free.app", "repl.co", "glitch.me",
    "readthedocs.io", "surge.sh", "now.sh", "deno.dev", "r2.dev", "trycloudflare.com", "duckdns.org",
})


def is_public_suffix(name: str) -> bool:
    """`name` (normalized: lower case, no trailing dot) is a public suffix."""
    return "." not in name or name in _MULTI_LABEL
