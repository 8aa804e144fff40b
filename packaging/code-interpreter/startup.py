"""IPython startup file of OpenDsec's code interpreter (docs/e2b.md "Code interpreter"): a
pandas DataFrame shown as a result carries its table as data too, beside its HTML, as
pandas' "split" JSON (`{"columns": [...], "index": [...], "data": [[...], ...]}`), which
E2B's SDKs hand out as `Result.data`."""


def _opendsec_formatters() -> None:
    import json

    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    ip = get_ipython()
    if ip is None:
        return

    class DataFormatter(BaseFormatter):
        format_type = Unicode("application/vnd.opendsec.data+json")
        print_method = ObjectName("_repr_opendsec_data_")
        _return_type = (dict,)

    f = DataFormatter(parent=ip.display_formatter)
    ip.display_formatter.formatters[f.format_type] = f
    # Only the types active when IPython started are computed unless told.
    if f.format_type not in ip.display_formatter.active_types:
        ip.display_formatter.active_types.append(f.format_type)
    def table(df: object) -> dict:
        return json.loads(df.to_json(orient="split", date_format="iso", default_handler=str))  # type: ignore[attr-defined]

    # By name, so pandas is imported only by code that uses it; pandas 3 names its
    # classes' module `pandas`, earlier releases `pandas.core.frame`.
    for module in ("pandas", "pandas.core.frame"):
        f.for_type_by_name(module, "DataFrame", table)


_opendsec_formatters()
del _opendsec_formatters
