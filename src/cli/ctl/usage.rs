//! `usage [<project>] [-from D] [-to D] [-daily] [-csv]` (10-cli; 13-iam §5): a table or CSV
//! of sandboxes started and sandbox, CPU core, memory GB and GPU hours per project.

use argh::FromArgs;

use super::{output, values, CtlError, Ctx};
use crate::pb;
use crate::types::{names, Failure};

/// The columns, in order, of both the table and the CSV.
pub const COLUMNS: [&str; 7] = [
    "day",
    "project",
    "sandboxes_started",
    "sandbox_hours",
    "cpu_core_hours",
    "memory_gb_hours",
    "gpu_hours",
];

#[derive(FromArgs, Debug)]
/// usage of a project (default -project) and its subprojects, per UTC day; by default each
/// project's total over the period, the last row the grand total
#[argh(
    subcommand,
    name = "usage",
    help_triggers("-h", "--help", "help"),
    example = "{command_name} root/team-a -from 2026-10-01 -to 2026-10-31",
    example = "{command_name} root -from 2026-10-01 -daily -csv > usage.csv"
)]
pub struct UsageArgs {
    /// project path
    #[argh(positional)]
    pub project: Option<String>,
    /// first day, YYYY-MM-DD (inclusive)
    #[argh(option)]
    pub from: Option<String>,
    /// last day, YYYY-MM-DD (inclusive)
    #[argh(option)]
    pub to: Option<String>,
    /// one row per day and project
    #[argh(switch)]
    pub daily: bool,
    /// CSV instead of a table
    #[argh(switch)]
    pub csv: bool,
}

impl UsageArgs {
    /// Fetches the report and prints it. Errors: `invalid` for a bad project or date (or
    /// -from after -to); the server's failure.
    pub async fn run(self, ctx: &Ctx) -> Result<(), CtlError> {
        if let Some(p) = &self.project {
            names::check_project_path(p)?;
        }
        let start = self.from.unwrap_or_default();
        let end = self.to.unwrap_or_default();
        if !start.is_empty() {
            values::date("from", &start)?;
        }
        if !end.is_empty() {
            values::date("to", &end)?;
        }
        if !start.is_empty() && !end.is_empty() && start > end {
            return Err(Failure::invalid(format!("-from {start} is after -to {end}")).into());
        }
        let conn = ctx.connect()?;
        let req = pb::GetUsageRequest {
            project: self.project.unwrap_or_else(|| conn.project.clone()),
            start,
            end,
            daily: self.daily,
        };
        let report = conn
            .call(req, |mut c, r| async move { c.get_usage(r).await })
            .await?;
        let text = if self.csv {
            csv(&report.rows)
        } else {
            table(&report.rows)
        };
        output::out(text.as_bytes())
    }
}

/// A number of hours, with up to `places` decimals and no trailing zeros (`1.5`, `2`).
fn hours(v: f64, places: usize) -> String {
    let s = format!("{v:.places$}");
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        &s
    };
    if s == "-0" {
        "0".into()
    } else {
        s.to_string()
    }
}

fn cells(r: &pb::UsageRow, places: usize) -> [String; 7] {
    [
        r.day.clone(),
        r.project.clone(),
        r.sandboxes_started.to_string(),
        hours(r.sandbox_hours, places),
        hours(r.cpu_core_hours, places),
        hours(r.memory_gb_hours, places),
        hours(r.gpu_hours, places),
    ]
}

/// One CSV field per RFC 4180: quoted when it holds a comma, quote or line break.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// The report as CSV: a header line of [`COLUMNS`], then one line per row (hours with up
/// to 6 decimals).
pub fn csv(rows: &[pb::UsageRow]) -> String {
    let mut out = COLUMNS.join(",");
    out.push('\n');
    for r in rows {
        let line: Vec<String> = cells(r, 6).iter().map(|c| csv_field(c)).collect();
        out.push_str(&line.join(","));
        out.push('\n');
    }
    out
}

/// The report as an aligned table: text columns left, numbers right (hours with up to 3
/// decimals).
pub fn table(rows: &[pb::UsageRow]) -> String {
    let body: Vec<[String; 7]> = rows.iter().map(|r| cells(r, 3)).collect();
    let mut width: Vec<usize> = COLUMNS.iter().map(|c| c.chars().count()).collect();
    for row in &body {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |row: &[String]| -> String {
        let cols: Vec<String> = row
            .iter()
            .zip(&width)
            .enumerate()
            .map(|(i, (c, &w))| {
                if i < 2 {
                    format!("{c:<w$}")
                } else {
                    format!("{c:>w$}")
                }
            })
            .collect();
        format!("{}\n", cols.join("  ").trim_end())
    };
    let header: Vec<String> = COLUMNS.iter().map(|c| c.to_string()).collect();
    let mut out = line(&header);
    for row in &body {
        out.push_str(&line(row));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows() -> Vec<pb::UsageRow> {
        vec![
            pb::UsageRow {
                project: "root/team-a".into(),
                day: "2026-10-01".into(),
                sandboxes_started: 12,
                sandbox_hours: 3.5,
                cpu_core_hours: 7.0,
                memory_gb_hours: 0.1 + 0.2,
                gpu_hours: 0.0,
            },
            pb::UsageRow {
                project: "root/a,b \"x\"".into(),
                day: "total".into(),
                sandboxes_started: 1,
                sandbox_hours: 1.0 / 3.0,
                ..Default::default()
            },
        ]
    }

    #[test]
    fn csv_has_the_spec_columns_and_escapes() {
        assert_eq!(
            csv(&rows()),
            "day,project,sandboxes_started,sandbox_hours,cpu_core_hours,memory_gb_hours,gpu_hours\n\
             2026-10-01,root/team-a,12,3.5,7,0.3,0\n\
             total,\"root/a,b \"\"x\"\"\",1,0.333333,0,0,0\n"
        );
        assert_eq!(csv(&[]), "day,project,sandboxes_started,sandbox_hours,cpu_core_hours,memory_gb_hours,gpu_hours\n");
    }

    #[test]
    fn table_aligns_columns() {
        let t = table(&rows());
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(
            lines[0].starts_with(
                "day         project       sandboxes_started  sandbox_hours  cpu_core_hours"
            ),
            "{t}"
        );
        assert!(
            lines[1].starts_with(
                "2026-10-01  root/team-a                  12            3.5               7"
            ),
            "{t}"
        );
        assert!(lines[2].contains("0.333"), "{t}");
        // Every line ends at the same column: the numbers are right-aligned.
        assert!(
            lines
                .iter()
                .all(|l| l.chars().count() == lines[0].chars().count()),
            "{t}"
        );
    }
}
