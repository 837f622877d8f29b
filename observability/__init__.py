"""What a user looks at: Grafana dashboards built in code, Prometheus (runner, scrape
configuration, recording and alerting rules), and ``conveyor dashboard render``.

The Helm chart (``charts/conveyor/``) carries what this package generates: the dashboards'
JSON, the rules file and the operator's RBAC rules (``conveyor.observability.chart``).
"""
