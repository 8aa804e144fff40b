//! Usage accounting (docs/concepts.md): the time quota is held, per UTC day and project, kept for
//! 400 days; and the `GetUsage` report, which counts live leases up to the query's time.

use std::collections::BTreeMap;

use chrono::NaiveDate;

use super::state::{IamState, Lease, UsageRow};
use crate::types::{names, Failure, Res};

/// Days of usage kept.
pub const KEEP_DAYS: i64 = 400;
const DAY: i64 = 86400;
/// Days from 0001-01-01 (chrono's "CE" day 1) to 1970-01-01.
const UNIX_EPOCH_CE: i64 = 719_163;

/// The UTC day (days since 1970-01-01) of unix time `t`.
pub fn day_of(t: i64) -> i64 {
    t.div_euclid(DAY)
}

/// Parses `YYYY-MM-DD` into a day number; anything else is `invalid`.
pub fn parse_day(s: &str) -> Result<i64, Failure> {
    let d = NaiveDate::parse_from_str(s, "%Y-%m-%d")
        .map_err(|_| Failure::invalid(format!("date {s:?} must be YYYY-MM-DD")))?;
    Ok(i64::from(chrono::Datelike::num_days_from_ce(&d)) - UNIX_EPOCH_CE)
}

/// Formats a day number as `YYYY-MM-DD`.
pub fn format_day(day: i64) -> String {
    i32::try_from(day + UNIX_EPOCH_CE)
        .ok()
        .and_then(NaiveDate::from_num_days_from_ce_opt)
        .map(|d| d.format("%Y-%m-%d").to_string())
        .unwrap_or_else(|| format!("day-{day}"))
}

/// Calls `f(day, seconds)` for each UTC day that `[from, to)` covers within `[first, last]`.
fn for_each_day(from: i64, to: i64, first: i64, last: i64, mut f: impl FnMut(i64, i64)) {
    let mut t = from.max(first.saturating_mul(DAY));
    let stop = to.min((last.saturating_add(1)).saturating_mul(DAY));
    while t < stop {
        let day = day_of(t);
        let end = ((day + 1) * DAY).min(stop);
        f(day, end - t);
        t = end;
    }
}

/// Adds the usage of holding `res` over `seconds` to `row`.
fn add_held(row: &mut UsageRow, res: &Res, seconds: i64) {
    let h = seconds as f64 / 3600.0;
    row.sandbox_hours += h;
    row.cpu_core_hours += res.cpu_cores * h;
    row.memory_gb_hours += res.memory_mb as f64 / 1024.0 * h;
    row.gpu_hours += res.gpus as f64 * h;
}

/// Records that `project` held `res` from `from` to `to`, split across UTC days; days older
/// than the retention at `now` are not recorded.
pub fn record_held(st: &mut IamState, project: &str, res: &Res, from: i64, to: i64, now: i64) {
    let first = day_of(now) - KEEP_DAYS + 1;
    for_each_day(from, to, first, i64::MAX / DAY - 1, |day, secs| {
        let row = st
            .usage
            .entry(day)
            .or_default()
            .entry(project.to_string())
            .or_default();
        add_held(row, res, secs);
    });
}

/// Counts one sandbox started in `project` at `at`.
pub fn record_started(st: &mut IamState, project: &str, at: i64) {
    st.usage
        .entry(day_of(at))
        .or_default()
        .entry(project.to_string())
        .or_default()
        .sandboxes_started += 1;
}

/// Takes back a start counted at `at` by `record_started` (a creation refused before any
/// sandbox was made); never below 0, and nothing for a day already pruned.
pub fn unrecord_started(st: &mut IamState, project: &str, at: i64) {
    let day = day_of(at);
    let Some(rows) = st.usage.get_mut(&day) else {
        return;
    };
    if let Some(row) = rows.get_mut(project) {
        row.sandboxes_started = (row.sandboxes_started - 1).max(0);
        // A row of nothing would list the project in reports as if it had used something.
        if *row == UsageRow::default() {
            rows.remove(project);
        }
    }
    if rows.is_empty() {
        st.usage.remove(&day);
    }
}

/// Drops days older than the retention at `now`.
pub fn prune(st: &mut IamState, now: i64) {
    let first = day_of(now) - KEEP_DAYS + 1;
    while let Some((&d, _)) = st.usage.first_key_value() {
        if d >= first {
            break;
        }
        st.usage.remove(&d);
    }
}

/// One row of a usage report.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportRow {
    pub project: String,
    /// `YYYY-MM-DD`, or `total`.
    pub day: String,
    pub row: UsageRow,
}

/// The usage of `project` and its subprojects from `start` to `end` (`YYYY-MM-DD`, inclusive;
/// empty = the retention's first day / today), live leases counted up to `now`. Daily: one
/// row per day and project. Otherwise: one total row per project, then an overall `total` row
/// (whose project is `project`). Bad dates are `invalid`.
pub fn report(
    st: &IamState,
    project: &str,
    start: &str,
    end: &str,
    daily: bool,
    now: i64,
) -> Result<Vec<ReportRow>, Failure> {
    names::check_project_path(project)?;
    let today = day_of(now);
    let first = if start.is_empty() {
        today - KEEP_DAYS + 1
    } else {
        parse_day(start)?
    };
    let last = if end.is_empty() {
        today
    } else {
        parse_day(end)?
    };
    if last < first {
        return Err(Failure::invalid(format!(
            "end {end} is before start {start}"
        )));
    }
    // (day, project) -> row
    let mut rows: BTreeMap<(i64, String), UsageRow> = BTreeMap::new();
    for (day, per) in st.usage.range(first..=last) {
        for (p, r) in per
            .iter()
            .filter(|(p, _)| names::project_within(p, project))
        {
            rows.entry((*day, p.clone())).or_default().add(r);
        }
    }
    for l in st
        .leases
        .values()
        .filter(|l: &&Lease| names::project_within(&l.project, project))
    {
        for_each_day(l.created_at, now, first, last, |day, secs| {
            add_held(
                rows.entry((day, l.project.clone())).or_default(),
                &l.resources,
                secs,
            );
        });
    }
    if daily {
        return Ok(rows
            .into_iter()
            .map(|((d, p), row)| ReportRow {
                project: p,
                day: format_day(d),
                row,
            })
            .collect());
    }
    let mut per: BTreeMap<String, UsageRow> = BTreeMap::new();
    let mut total = UsageRow::default();
    for ((_, p), row) in rows {
        per.entry(p).or_default().add(&row);
        total.add(&row);
    }
    let mut out: Vec<ReportRow> = per
        .into_iter()
        .map(|(p, row)| ReportRow {
            project: p,
            day: "total".into(),
            row,
        })
        .collect();
    out.push(ReportRow {
        project: project.to_string(),
        day: "total".into(),
        row: total,
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_parse_and_format() {
        assert_eq!(parse_day("1970-01-01").unwrap(), 0);
        assert_eq!(parse_day("1970-01-02").unwrap(), 1);
        assert_eq!(format_day(parse_day("2026-10-31").unwrap()), "2026-10-31");
        for bad in ["2026-13-01", "yesterday", "2026-1-1x", ""] {
            assert!(parse_day(bad).is_err(), "{bad}");
        }
        assert_eq!(day_of(86399), 0);
        assert_eq!(day_of(86400), 1);
    }

    #[test]
    fn held_time_is_split_across_utc_days() {
        let mut st = IamState::default();
        let d = parse_day("2026-10-01").unwrap();
        let res = Res {
            cpu_cores: 2.0,
            memory_mb: 2048,
            gpus: 1,
            sandboxes: 1,
            ..Default::default()
        };
        // 23:00 on day d to 02:00 on day d+1: 1 h then 2 h.
        let from = d * DAY + 23 * 3600;
        record_held(
            &mut st,
            "root/a",
            &res,
            from,
            from + 3 * 3600,
            from + 3 * 3600,
        );
        let r0 = st.usage[&d]["root/a"];
        let r1 = st.usage[&(d + 1)]["root/a"];
        assert_eq!(r0.sandbox_hours, 1.0);
        assert_eq!(r0.cpu_core_hours, 2.0);
        assert_eq!(r0.memory_gb_hours, 2.0);
        assert_eq!(r0.gpu_hours, 1.0);
        assert_eq!(r1.sandbox_hours, 2.0);
    }

    #[test]
    fn only_400_days_are_kept() {
        let mut st = IamState::default();
        let now = 1000 * DAY + 3600;
        let res = Res {
            sandboxes: 1,
            ..Default::default()
        };
        record_held(&mut st, "root", &res, now - 500 * DAY, now, now);
        assert_eq!(st.usage.len() as i64, KEEP_DAYS);
        record_started(&mut st, "root", now - 450 * DAY);
        prune(&mut st, now);
        assert_eq!(
            *st.usage.keys().next().unwrap(),
            day_of(now) - KEEP_DAYS + 1
        );
    }

    #[test]
    fn reports_cover_subprojects_live_leases_and_a_total() {
        let mut st = IamState::default();
        let d = parse_day("2026-10-01").unwrap();
        let one = Res {
            cpu_cores: 1.0,
            sandboxes: 1,
            ..Default::default()
        };
        record_started(&mut st, "root/a", d * DAY);
        record_held(
            &mut st,
            "root/a",
            &one,
            d * DAY,
            d * DAY + 3600,
            d * DAY + 3600,
        );
        record_held(
            &mut st,
            "root/a/b",
            &one,
            d * DAY,
            d * DAY + 7200,
            d * DAY + 7200,
        );
        record_held(
            &mut st,
            "root/ab",
            &one,
            d * DAY,
            d * DAY + 7200,
            d * DAY + 7200,
        );
        st.leases.insert(
            "l1".into(),
            Lease {
                project: "root/a/b".into(),
                resources: one,
                created_at: (d + 1) * DAY,
                ..Default::default()
            },
        );
        let now = (d + 1) * DAY + 1800;
        let daily = report(&st, "root/a", "2026-10-01", "2026-10-02", true, now).unwrap();
        let got: Vec<(String, String, f64)> = daily
            .iter()
            .map(|r| (r.day.clone(), r.project.clone(), r.row.sandbox_hours))
            .collect();
        assert_eq!(
            got,
            vec![
                ("2026-10-01".into(), "root/a".into(), 1.0),
                ("2026-10-01".into(), "root/a/b".into(), 2.0),
                ("2026-10-02".into(), "root/a/b".into(), 0.5),
            ]
        );
        let totals = report(&st, "root/a", "2026-10-01", "2026-10-31", false, now).unwrap();
        assert_eq!(totals.len(), 3);
        assert_eq!(totals[1].project, "root/a/b");
        assert_eq!(totals[1].row.sandbox_hours, 2.5);
        let last = totals.last().unwrap();
        assert_eq!(
            (last.day.as_str(), last.project.as_str()),
            ("total", "root/a")
        );
        assert_eq!(last.row.sandbox_hours, 3.5);
        assert_eq!(last.row.sandboxes_started, 1);
        // A range before everything has only the zero total.
        let none = report(&st, "root/a", "2020-01-01", "2020-01-02", false, now).unwrap();
        assert_eq!(none.len(), 1);
        assert_eq!(none[0].row, UsageRow::default());
        assert_eq!(
            report(&st, "root/a", "2026-10-02", "2026-10-01", false, now)
                .unwrap_err()
                .reason,
            crate::types::Reason::Invalid
        );
        assert_eq!(
            report(&st, "root/a", "10/01/2026", "", false, now)
                .unwrap_err()
                .reason,
            crate::types::Reason::Invalid
        );
    }
}
