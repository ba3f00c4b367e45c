"""Alerts: failed tasks (as Airflow ``on_failure_callback`` notifiers) and maintenance findings,
sent by e-mail and to a Slack-compatible webhook.

Settings come from the pipeline file's ``alerts`` section (:class:`tidemark.config.Alerts`)
and from Airflow connections:

* e-mail: the SMTP connection ``alerts.smtp_conn_id`` (default ``smtp_default``, the smtp
  provider's connection: host, port, login/password, extra ``from_email``, ``disable_tls``,
  ``disable_ssl``), sent to ``alerts.email``;
* webhook: the connection ``alerts.webhook_conn_id`` holds the URL. Accepted forms:

  - ``host`` is the whole URL, ``http://...`` or ``https://...`` (conn_type ``http``);
  - ``host`` is a host name (optionally followed by ``/path``), ``port`` is optional and the
    scheme is ``schema`` when that is ``http`` or ``https`` (as for Airflow's HTTP
    connections), else the conn_type when that is ``http`` or ``https``, else https;
  - a URI such as ``AIRFLOW_CONN_X='https://hooks.slack.com/services/T0/B0/XX'`` (Airflow
    stores the scheme as conn_type and the path as schema; it is put back together);
  - a ``password``, if set, is the Slack-style secret path token, appended to the URL only
    when the URL has no path of its own: host ``https://hooks.slack.com``, password
    ``services/T0/B0/XX`` (kept in the password, Airflow masks it in logs).

  Sent by the HTTP provider's ``HttpNotifier`` (its ``HttpHook``: the connection's login,
  extra headers and proxies apply). The body is Slack's plain form ``{"text": "..."}`` (no
  blocks), which Slack, Mattermost,
  Rocket.Chat, Discord's ``/slack`` endpoint and most chat webhooks accept. Logs name only
  ``scheme://host:port`` of the webhook, never its secret path or token.

An alert that cannot be delivered is logged in one line and never raises: it must not hide
the failure it reports. The e-mail is built here (not from Jinja templates), so an error
message holding ``{{`` or ``{%`` is sent verbatim.
"""

from __future__ import annotations

import html
import logging
import os
import re
from collections.abc import Mapping
from functools import cached_property
from typing import Any
from urllib.parse import quote, urlsplit

from airflow.providers.http.hooks.http import HttpHook
from airflow.providers.http.notifications.http import HttpNotifier
from airflow.sdk import BaseHook, BaseNotifier
from airflow.sdk.log import mask_secret

from tidemark.core import dsn as dsnmod
from tidemark.core.text import clamp

DLQ_PATH = "/tidemark/dlq/"  # served by the DLQ UI plugin under the API server's base URL
ERROR_MAX_CHARS = 300
WEBHOOK_TIMEOUT_SECONDS = 10.0
DEFAULT_BASE_URL = "http://localhost:8080"  # Airflow's own fallback for api.base_url

log = logging.getLogger(__name__)
_URL = re.compile(r"(https?://[^\s<>\"]+)")


# -- text ----------------------------------------------------------------------------------------


def base_url() -> str:
    """The Airflow UI's base URL: ``AIRFLOW__API__BASE_URL``, else ``[api] base_url``."""
    url = os.environ.get("AIRFLOW__API__BASE_URL")
    if not url:
        try:
            from airflow.sdk.configuration import conf

            url = conf.get("api", "base_url", fallback=None)
        except Exception:  # noqa: BLE001 - no configuration: use Airflow's default
            url = None
    return (url or DEFAULT_BASE_URL).rstrip("/")


def dlq_link(pipeline_name: str) -> str:
    return f"{base_url()}{DLQ_PATH}?pipeline={quote(pipeline_name)}"


def log_link(context: Mapping[str, Any]) -> str:
    """The task try's log page: ``ti.log_url`` when the task instance has one, else built the
    way Airflow builds it."""
    ti = context.get("ti") or context.get("task_instance")
    try:
        url = getattr(ti, "log_url", None)
    except Exception:  # noqa: BLE001 - a property that needs configuration
        url = None
    if url:
        return str(url)
    dag_id, run_id, task_id, try_number, map_index = _ids(context)
    mapped = f"/mapped/{map_index}" if isinstance(map_index, int) and map_index >= 0 else ""
    tries = f"?try_number={try_number}" if isinstance(try_number, int) and try_number > 0 else ""
    return (
        f"{base_url()}/dags/{quote(str(dag_id))}/runs/{quote(str(run_id))}"
        f"/tasks/{quote(str(task_id))}{mapped}{tries}"
    )


def error_line(error: object) -> str:
    """The error in one line: the job's own ``tidemark: ...`` line when the message carries the
    job's output (SparkSubmitOperator appends its tail), else the first non-empty line; DSN
    passwords (and secrets Airflow's masker knows) masked, at most ERROR_MAX_CHARS characters."""
    if error is None:
        return "(no error recorded)"
    text = _redact(dsnmod.mask(str(error)))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    job = [ln for ln in lines if ln.startswith("tidemark: ")]
    if job:
        return clamp(job[-1].removeprefix("tidemark: "), ERROR_MAX_CHARS)
    first = lines[0] if lines else ""
    if isinstance(error, BaseException):
        first = f"{type(error).__name__}: {first}" if first else type(error).__name__
    return clamp(first or "(no message)", ERROR_MAX_CHARS)


def _redact(text: str) -> str:
    """Airflow's secrets masker too: connection passwords and sensitive variables the task
    has seen are replaced by ``***`` (as in the task log)."""
    try:
        from airflow.sdk.log import redact

        return str(redact(text))
    except Exception:  # noqa: BLE001 - no masker: the DSN masking above still applies
        return text


def _ids(context: Mapping[str, Any]) -> tuple:
    ti = context.get("ti") or context.get("task_instance")
    dag = context.get("dag")
    dag_run = context.get("dag_run")
    dag_id = getattr(ti, "dag_id", None) or getattr(dag, "dag_id", None) or "?"
    run_id = (
        getattr(ti, "run_id", None)
        or context.get("run_id")
        or getattr(dag_run, "run_id", None)
        or "?"
    )
    task_id = getattr(ti, "task_id", None) or getattr(context.get("task"), "task_id", None) or "?"
    return dag_id, run_id, task_id, getattr(ti, "try_number", None), getattr(ti, "map_index", None)


def alert_text(context: Mapping[str, Any], pipeline_name: str | None = None) -> tuple[str, str]:
    """``(subject, body)`` of a failed-task alert from an Airflow callback context."""
    dag_id, run_id, task_id, try_number, map_index = _ids(context)
    name = pipeline_name or str(dag_id)
    subject = f"[tidemark] {name}: task {task_id} failed (run {run_id})"
    task = f"{task_id}[{map_index}]" if isinstance(map_index, int) and map_index >= 0 else task_id
    lines = [
        f"pipeline: {name}",
        f"dag: {dag_id}",
        f"task: {task}",
        f"run: {run_id}",
        f"try: {try_number if try_number is not None else '?'}",
        f"error: {error_line(context.get('exception'))}",
        f"log: {log_link(context)}",
        f"dead-letter queue: {dlq_link(name)}",
    ]
    return subject, "\n".join(lines)


def _html(body: str) -> str:
    """Plain text as HTML: escaped, one line per line, URLs as links."""
    out = []
    for line in body.splitlines():
        parts = _URL.split(line)
        out.append(
            "".join(
                f'<a href="{html.escape(p)}">{html.escape(p, quote=False)}</a>'
                if i % 2
                else html.escape(p, quote=False)
                for i, p in enumerate(parts)
            )
        )
    return (
        '<div style="font-family: monospace; white-space: pre-wrap">'
        + "<br>\n".join(out)
        + "</div>"
    )


def _one_line(exc: BaseException, *secrets: str) -> str:
    text = " ".join(str(exc).split())
    for s in sorted(secrets, key=len, reverse=True):
        if s:
            text = text.replace(s, "***")
    text = _redact(dsnmod.mask(text))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# -- webhook -------------------------------------------------------------------------------------


def webhook_url(conn: Any) -> str:
    """The URL a webhook connection describes (forms in the module docstring)."""
    host = (conn.host or "").strip()
    token = (conn.password or "").strip().strip("/")
    if host.lower().startswith(("http://", "https://")):
        url = host
    else:
        if not host:
            raise ValueError("the connection has no host")
        schema = (conn.schema or "").strip()
        ctype = (conn.conn_type or "").lower()
        if schema.lower() in ("http", "https"):
            scheme, path = schema.lower(), ""
        else:
            scheme, path = (ctype if ctype in ("http", "https") else "https"), schema.strip("/")
        name, _, host_path = host.partition("/")
        netloc = f"{name}:{conn.port}" if conn.port and ":" not in name else name
        parts = [p for p in (host_path.strip("/"), path) if p]
        url = f"{scheme}://{netloc}" + ("/" + "/".join(parts) if parts else "")
    if token and urlsplit(url).path in ("", "/"):
        url = url.rstrip("/") + "/" + token
    return url


def _origin(url: str) -> str:
    """``scheme://host[:port]`` of a URL: what may be logged of a webhook."""
    try:
        u = urlsplit(url)
        port = f":{u.port}" if u.port else ""
        return f"{u.scheme}://{u.hostname}{port}"
    except ValueError:
        return "(unparsable URL)"


class _Alert(BaseNotifier):
    """A notifier whose text is built in Python from the context: nothing to render with
    Jinja (so any context works, and an error message holding ``{{`` is sent as it is)."""

    def render_template_fields(self, context, jinja_env=None) -> None:
        return None


class _WebhookHook(HttpHook):
    """The HTTP provider's hook, posting to the whole URL its connection describes (the
    forms above, a superset of HttpHook's) and accepting only a 2xx answer."""

    def url_from_endpoint(self, endpoint: str | None) -> str:
        return webhook_url(self.get_connection(self.http_conn_id))

    def check_response(self, response) -> None:
        if not 200 <= response.status_code < 300:
            raise _HTTPStatus(response.status_code)


class _HTTPStatus(Exception):
    def __init__(self, status: int):
        super().__init__(f"HTTP {status}")


class _Hide(logging.Filter):
    """Replaces the webhook's secrets in records of a logger that prints URLs (urllib3 logs
    each request's path at DEBUG)."""

    def __init__(self, secrets: list[str]):
        super().__init__()
        self.secrets = sorted((x for x in secrets if x), key=len, reverse=True)

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        for x in self.secrets:
            text = text.replace(x, "***")
        record.msg, record.args = text, None
        return True


# Loggers that print a request's URL: urllib3's, and the hook's (HttpHook logs the URL, and
# a connection error's text holding it, before raising), which logs through this stdlib
# logger so that the filter applies wherever the process sends its logs.
_HOOK_LOGGER = "tidemark.airflow.alerts.webhook"
_URL_LOGGERS = ("urllib3.connectionpool", _HOOK_LOGGER)


class WebhookNotifier(HttpNotifier):
    """Posts ``{"text": ...}`` to the Slack-compatible webhook of an Airflow connection,
    through the HTTP provider's notifier and hook. The URL's path (and a password token) are
    secrets: registered with Airflow's masker, hidden from urllib3's log, and never in the
    errors this raises or logs."""

    def __init__(self, webhook_conn_id: str, pipeline_name: str | None = None, **kwargs):
        super().__init__(
            http_conn_id=webhook_conn_id,
            method="POST",
            headers={"Content-Type": "application/json"},
            extra_options={"timeout": WEBHOOK_TIMEOUT_SECONDS},
            **kwargs,
        )
        self.webhook_conn_id = webhook_conn_id
        self.pipeline_name = pipeline_name

    @cached_property
    def hook(self) -> HttpHook:
        hook = _WebhookHook(method=self.method, http_conn_id=self.http_conn_id)
        # LoggingMixin's logger slot: it takes a stdlib logger, though typed as structlog's
        hook._log = logging.getLogger(_HOOK_LOGGER)  # type: ignore[assignment]
        return hook

    def render_template_fields(self, context, jinja_env=None) -> None:
        return None  # the text is built in Python: an error holding {{ is sent as it is

    def post(self, text: str) -> None:
        """Post one message; raises RuntimeError (with a loggable, secret-free message)."""
        try:
            conn = BaseHook.get_connection(self.webhook_conn_id)
            url = webhook_url(conn)
        except Exception as exc:  # noqa: BLE001 - whatever Airflow raises: one line
            raise RuntimeError(
                f"webhook connection {self.webhook_conn_id!r}: {_one_line(exc)}"
            ) from None
        where = f"{_origin(url)} (connection {self.webhook_conn_id})"
        path = urlsplit(url).path
        secrets = [url, path if len(path) > 1 else "", conn.password or ""]
        for x in secrets:
            if x:
                mask_secret(x)
        hide = _Hide(secrets)
        loggers = [logging.getLogger(n) for n in _URL_LOGGERS]
        for lg in loggers:
            lg.addFilter(hide)
        self.json = {"text": text}
        try:
            HttpNotifier.notify(self, {})
        except _HTTPStatus as exc:
            raise RuntimeError(f"webhook {where}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - any failure: one line, secrets masked
            raise RuntimeError(f"webhook {where}: {_one_line(exc, *secrets)}") from None
        finally:
            self.json = None
            for lg in loggers:
                lg.removeFilter(hide)

    def notify(self, context) -> None:
        subject, body = alert_text(context, self.pipeline_name)
        try:
            self.post(f"{subject}\n{body}")
        except Exception as exc:  # noqa: BLE001 - never hide the task's own failure
            self.log.error("alert not sent: %s", exc)


# -- e-mail --------------------------------------------------------------------------------------


class EmailAlert(_Alert):
    """E-mails the alert through the smtp provider's SmtpHook (connection ``smtp_conn_id``;
    the sender is the connection's ``from_email`` extra unless ``from_email`` is given)."""

    def __init__(
        self,
        to: list[str] | str,
        pipeline_name: str | None = None,
        smtp_conn_id: str = "smtp_default",
        from_email: str | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.to = [to] if isinstance(to, str) else list(to)
        self.pipeline_name = pipeline_name
        self.smtp_conn_id = smtp_conn_id
        self.from_email = from_email

    def send_mail(self, subject: str, body: str) -> None:
        """Send one message; raises RuntimeError (with a masked one-line message)."""
        from airflow.providers.smtp.hooks.smtp import SmtpHook

        subject = " ".join(subject.split())  # one header line, whatever the caller passed
        try:
            with SmtpHook(smtp_conn_id=self.smtp_conn_id) as hook:
                hook.send_email_smtp(
                    to=self.to,
                    subject=subject,
                    html_content=_html(body),
                    from_email=self.from_email,
                )
        except Exception as exc:  # noqa: BLE001 - whatever SMTP raises: one line
            raise RuntimeError(
                f"e-mail via connection {self.smtp_conn_id} to "
                f"{', '.join(self.to)}: {_one_line(exc)}"
            ) from None

    def notify(self, context) -> None:
        subject, body = alert_text(context, self.pipeline_name)
        try:
            self.send_mail(subject, body)
        except Exception as exc:  # noqa: BLE001 - never hide the task's own failure
            self.log.error("alert not sent: %s", exc)


# -- per pipeline --------------------------------------------------------------------------------


def failure_notifiers(pipeline) -> list[BaseNotifier]:
    """The ``on_failure_callback`` notifiers of a pipeline (:class:`tidemark.config.Pipeline`):
    e-mail when ``alerts.email`` lists addresses, the webhook when ``alerts.webhook_conn_id``
    is set; an empty list when neither."""
    a = pipeline.alerts
    out: list[BaseNotifier] = []
    if a.email:
        out.append(EmailAlert(to=a.email, pipeline_name=pipeline.name, smtp_conn_id=a.smtp_conn_id))
    if a.webhook_conn_id:
        out.append(WebhookNotifier(a.webhook_conn_id, pipeline_name=pipeline.name))
    return out


def send(pipeline, subject: str, body: str) -> list[str]:
    """Send a non-task alert (e.g. a maintenance threshold breach) through the pipeline's
    channels. The subject is made one line and prefixed with ``[tidemark] <pipeline>: `` unless it already starts
    with ``[tidemark]``. Returns the channels that delivered it (``"email"``, ``"webhook"``);
    a channel that failed is logged in one line."""
    subject = " ".join(subject.split())
    if not subject.startswith("[tidemark]"):
        subject = f"[tidemark] {pipeline.name}: {subject}"
    delivered = []
    for notifier in failure_notifiers(pipeline):
        try:
            if isinstance(notifier, EmailAlert):
                notifier.send_mail(subject, body)
                delivered.append("email")
            elif isinstance(notifier, WebhookNotifier):
                notifier.post(f"{subject}\n{body}")
                delivered.append("webhook")
        except Exception as exc:  # noqa: BLE001 - an alert never hides the task's own failure
            log.error("alert not sent: %s", exc)
    return delivered
