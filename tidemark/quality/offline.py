"""Data Docs that are styled with no network: the CSS, fonts and scripts Great Expectations'
pages load from CDNs are shipped with Tidemark (tidemark/quality/vendor, SOURCES.md there), put
in each site's ``static/vendor/`` and referenced from its pages by relative paths, which work
from a file and from the Dead letters page that serves the site alike.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

VENDOR = Path(__file__).resolve().parent / "vendor"
SITE_VENDOR = ("static", "vendor")  # where a site keeps its copy

# Each CDN address GX 1.x's page templates name -> the shipped file (relative to VENDOR).
CDN = {
    "https://maxcdn.bootstrapcdn.com/bootstrap/4.3.1/css/bootstrap.min.css": "css/bootstrap.min.css",
    "https://stackpath.bootstrapcdn.com/bootstrap/4.3.1/js/bootstrap.min.js": "js/bootstrap.min.js",
    "https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.css": "css/bootstrap-table.min.css",
    "https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.js": "js/bootstrap-table.min.js",
    "https://unpkg.com/bootstrap-table@1.19.0/dist/extensions/filter-control/bootstrap-table-filter-control.css": "css/bootstrap-table-filter-control.min.css",
    "https://unpkg.com/bootstrap-table@1.19.0/dist/extensions/filter-control/bootstrap-table-filter-control.min.css": "css/bootstrap-table-filter-control.min.css",
    "https://unpkg.com/bootstrap-table@1.19.1/dist/extensions/filter-control/bootstrap-table-filter-control.min.js": "js/bootstrap-table-filter-control.min.js",
    "https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/css/bootstrap-datepicker.min.css": "css/bootstrap-datepicker.min.css",
    "https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/js/bootstrap-datepicker.min.js": "js/bootstrap-datepicker.min.js",
    "https://cdn.jsdelivr.net/npm/@forevolve/bootstrap-dark@1.1.0/dist/css/bootstrap-prefers-dark.css": "css/bootstrap-prefers-dark.min.css",
    "https://cdnjs.cloudflare.com/ajax/libs/font-awesome/6.6.0/css/all.min.css": "css/fontawesome-all.min.css",
    "https://code.jquery.com/jquery-3.7.1.min.js": "js/jquery.min.js",
    "https://cdnjs.cloudflare.com/ajax/libs/popper.js/1.12.9/umd/popper.min.js": "js/popper.min.js",
    "https://cdn.jsdelivr.net/npm/vega@5": "js/vega.min.js",
    "https://cdn.jsdelivr.net/npm/vega-lite@5": "js/vega-lite.min.js",
    "https://cdn.jsdelivr.net/npm/vega-embed@6": "js/vega-embed.min.js",
}  # fmt: skip
# GX's logo, fetched with the project's id in the query (a tracking request): its own copy
# is in every site's static/images.
GX_ASSETS = "https://great-expectations-web-assets.s3.us-east-2.amazonaws.com/"
_STYLES = ("static", "styles", "data_docs_default_styles.css")
_TAG = re.compile(r"<(?:script|link|img)\b[^>]*>", re.IGNORECASE)
_URL = re.compile(r"""(?P<attr>\b(?:src|href)=)(?P<q>["'])(?P<url>https?://[^"']+)(?P=q)""")
# A CDN's integrity hash and CORS mode: a page opened from a file would refuse a script
# loaded in CORS mode from another file.
_CDN_ONLY = re.compile(r"""\s+(?:integrity|crossorigin)=(["'])[^"']*\1""", re.IGNORECASE)


def install(site: str) -> None:
    """Put the shipped assets into ``site``'s ``static/vendor/`` (once: a file there is kept).
    Hard links where the site and the package share a file system, copies elsewhere."""
    dest = os.path.join(site, *SITE_VENDOR)
    for src in VENDOR.rglob("*"):
        if not src.is_file() or src.suffix not in (".css", ".js", ".woff2"):
            continue
        target = os.path.join(dest, src.relative_to(VENDOR))
        if os.path.exists(target):
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = f"{target}.tmp-{os.getpid()}"
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, target)  # never a half-copied file under the name a page loads
    # The stylesheet GX copies into the site draws its dark-mode logo from its web assets.
    styles = os.path.join(site, *_STYLES)
    if os.path.isfile(styles):
        with open(styles, encoding="utf-8") as f:
            css = f.read()
        local = css.replace(f"{GX_ASSETS}full_logo_dark.png", "../images/logo-long.png")
        if local != css:
            with open(styles + ".tmp", "w", encoding="utf-8") as f:
                f.write(local)
            os.replace(styles + ".tmp", styles)


def localize_page(page: str, site: str) -> bool:
    """Point ``page``'s CDN assets at the site's copies; True if it changed."""
    with open(page, encoding="utf-8") as f:
        html = f.read()
    up = os.path.relpath(site, os.path.dirname(page)).replace(os.sep, "/")
    base = "/".join(p for p in (up if up != "." else "", *SITE_VENDOR) if p)

    def tag(m: re.Match[str]) -> str:
        text = m[0]
        url = _URL.search(text)
        if url is None:
            return text
        if url["url"] in CDN:
            path = f"{base}/{CDN[url['url']]}"
        elif url["url"].startswith(GX_ASSETS):
            name = url["url"].removeprefix(GX_ASSETS).split("?", 1)[0]
            if not os.path.isfile(os.path.join(site, "static", "images", name)):
                return text
            path = "/".join(p for p in (up if up != "." else "", "static", "images", name) if p)
        else:
            return text
        local = f"{url['attr']}{url['q']}{path}{url['q']}"
        return _CDN_ONLY.sub("", text[: url.start()] + local + text[url.end() :])

    out = _TAG.sub(tag, html)
    # The same stylesheet, inlined into the page: its dark-mode logo.
    logo = "/".join(p for p in (up if up != "." else "", "static", "images", "logo-long.png") if p)
    out = out.replace(f"{GX_ASSETS}full_logo_dark.png", logo)
    if out == html:
        return False
    tmp = f"{page}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(out)
    os.replace(tmp, page)
    return True


def localize(site: str, pages: list[str] | None = None) -> int:
    """Install the assets into ``site`` and localize ``pages`` (default: every page of the
    site); returns how many pages changed."""
    install(site)
    if pages is None:
        pages = [str(p) for p in Path(site).rglob("*.html")]
    return sum(localize_page(p, site) for p in pages if os.path.isfile(p))
