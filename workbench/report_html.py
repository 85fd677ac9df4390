"""The HTML template of the batch report (``index.html``), rendered by Jinja2.

Autoescaping is on for the whole template: claim texts, parameters, errors and file names come
from notebooks and are escaped wherever they appear (a test puts ``<script>`` in a claim text).
"""
from __future__ import annotations

TEMPLATE = """<!doctype html>
<html><head><meta charset="utf-8"><title>Workbench report: {{ root }}</title>
<style>
body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
td.ok{background:#e3f4e1}td.bad{background:#fbe1e1}td.na{color:#999}td.text{max-width:480px}
td.num{text-align:right;font-variant-numeric:tabular-nums}
img{max-width:560px;margin:4px;border:1px solid #eee}h2{border-bottom:2px solid #1f5a96}
.fail{color:#b00}small{color:#666}
</style></head><body>
<h1>Workbench report</h1>
<p>{{ n_runs }} job(s) in <code>{{ root }}</code>
{%- if info.started %}, started {{ info.started }}{% endif %}
{%- if info.commits %}, git commit {% for c in info.commits %}<code>{{ c.commit }}</code>
{%- if c.dirty %} (with uncommitted changes){% endif %}{% if not loop.last %}, {% endif %}
{%- endfor %}{% endif %}
{%- if info.command %}: <code>{{ info.command }}</code>{% endif %}.</p>
<p>Tables:
<a href="results.csv">results.csv</a> (one row per job),
<a href="aggregate.csv">aggregate.csv</a> (one row per notebook, parameters and metric).</p>
{% if jobs %}
<h2>Jobs</h2>
<p><small><b>job time</b>: the whole job as the runner saw it (kernel start, papermill,
every cell, writing the results); <b>notebook time</b>: from the notebook's
<code>workbench.start()</code> to its <code>run.finish()</code>, as the notebook measured it
(blank when it did not finish).</small></p>
<table><tr><th>notebook</th><th>params</th><th>seed</th><th>status</th>
<th title="kernel start to results written, as the runner measured it">job time (s)</th>
<th title="workbench.start() to run.finish(), as the notebook measured it">notebook time (s)</th>
<th>note</th></tr>
{% for j in jobs %}<tr><td><a href="#{{ j.notebook }}">{{ j.notebook }}</a></td>
<td>{{ j.params }}</td><td>{{ j.seed }}</td>
<td class="{{ 'ok' if j.status in ('ok', 'cached') else 'bad' }}">{{ j.status }}</td>
<td class="num">{{ j.duration_s }}</td><td class="num">{{ j.run_s }}</td>
<td>{{ j.error }}{% if j.error_cell %} <small>({{ j.error_cell }})</small>{% endif %}
{%- if j.note %} <small>{{ j.note }}</small>{% endif %}</td></tr>
{% endfor %}</table>
{% endif %}
{% for nb in notebooks %}
<h2 id="{{ nb.name }}">{{ nb.name }}{% if nb.title %}: {{ nb.title }}{% endif %}</h2>
{% for r in nb.failed %}<p class="fail">{{ r.rel }}: {{ r.status }} {{ r.error }}
{%- if r.error_cell %} in {{ r.error_cell }}{% endif %}
 (<a href="{{ r.rel }}/log.txt">log</a>)</p>
{% endfor %}
<h3>Verdicts</h3>
{% if nb.claims.rows %}
<table><tr><th>claim</th><th>text</th>{% for c in nb.claims.columns %}<th>{{ c }}</th>{% endfor %}</tr>
{% for row in nb.claims.rows %}<tr><th>{{ row.id }}{% if row.robust %} (robust){% endif %}</th>
<td class="text">{{ row.text }}</td>
{% for v in row.cells %}{% if v is none %}<td class="na">-</td>
{% elif v %}<td class="ok">holds</td>{% else %}<td class="bad">does not hold</td>{% endif %}
{% endfor %}</tr>
{% endfor %}</table>
{% else %}<p>No claims recorded.</p>{% endif %}
{% if nb.aggregate.rows %}
<h3>Aggregate over seeds</h3>
<p><small>mean ± std (n seeds); a claim's mean is the share of seeds in which it held.</small></p>
<table><tr><th>metric</th>{% for p in nb.aggregate.params %}<th>{{ p }}</th>{% endfor %}</tr>
{% for row in nb.aggregate.rows %}<tr><th>{{ row.metric }}</th>
{% for c in row.cells %}{% if c is none %}<td class="na">-</td>{% else %}
<td class="num" title="seeds {{ c.seeds }}">{{ c.mean }} ± {{ c.std }} ({{ c.n }})</td>
{% endif %}{% endfor %}</tr>
{% endfor %}</table>
{% endif %}
{% for run in nb.runs %}
<details{% if loop.first %} open{% endif %}><summary>{{ run.rel }} ({{ run.status }},
{{ run.duration }} s)
{%- if run.notebook %} · <a href="{{ run.notebook }}">executed notebook</a>{% endif %}
{%- if run.log %} · <a href="{{ run.log }}">log</a>{% endif %}</summary>
{% for f in run.figures %}{% if f.image %}<a href="{{ f.href }}"><img src="{{ f.href }}"
 alt="{{ f.name }}"></a>{% else %}<a href="{{ f.href }}">{{ f.name }}</a>{% endif %}
{% endfor %}</details>
{% endfor %}
{% endfor %}
</body></html>
"""

_template = None


def render(**context) -> str:
    """``index.html`` for ``context`` (see :func:`workbench.report.build`)."""
    global _template
    if _template is None:
        import jinja2
        env = jinja2.Environment(autoescape=True, trim_blocks=True, lstrip_blocks=True,
                                 undefined=jinja2.StrictUndefined)
        _template = env.from_string(TEMPLATE)
    return _template.render(**context)
