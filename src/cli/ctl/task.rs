//! `task pause|resume|stop <task>` (docs/cli.md): acts on every sandbox of a task in
//! `-project` and prints how many succeeded (`affected`) and failed (`failed`, `errors`).

use argh::FromArgs;

use super::{output, values, CtlError, Ctx};
use crate::pb;

#[derive(FromArgs, Debug)]
/// pause, resume or stop every sandbox of a task in -project
#[argh(subcommand, name = "task", help_triggers("-h", "--help", "help"))]
pub struct TaskArgs {
    #[argh(subcommand)]
    pub cmd: TaskCmd,
}

#[derive(FromArgs, Debug)]
#[argh(subcommand)]
pub enum TaskCmd {
    Pause(PauseArgs),
    Resume(ResumeArgs),
    Stop(StopArgs),
}

macro_rules! task_command {
    ($ty:ident, $name:tt, $doc:tt) => {
        #[derive(FromArgs, Debug)]
        #[doc = $doc]
        #[argh(subcommand, name = $name, help_triggers("-h", "--help", "help"))]
        pub struct $ty {
            /// task name
            #[argh(positional)]
            pub task: String,
        }
    };
}

task_command!(
    PauseArgs,
    "pause",
    "pause every sandbox of the task; prints affected and failed"
);
task_command!(
    ResumeArgs,
    "resume",
    "resume every sandbox of the task; prints affected and failed"
);
task_command!(
    StopArgs,
    "stop",
    "stop every sandbox of the task; prints affected and failed"
);

#[derive(Clone, Copy)]
enum Op {
    Pause,
    Resume,
    Stop,
}

impl TaskArgs {
    /// Runs the action and prints the `TaskActionResult` as JSON.
    /// Errors: `invalid` for an empty task name; the server's failure.
    pub async fn run(self, ctx: &Ctx) -> Result<(), CtlError> {
        let (op, task) = match self.cmd {
            TaskCmd::Pause(a) => (Op::Pause, a.task),
            TaskCmd::Resume(a) => (Op::Resume, a.task),
            TaskCmd::Stop(a) => (Op::Stop, a.task),
        };
        values::plain("task", &task)?;
        let conn = ctx.connect()?;
        let req = pb::TaskRequest {
            project: conn.project.clone(),
            task_id: task,
        };
        let res = conn
            .call(req, |mut c, r| async move {
                match op {
                    Op::Pause => c.pause_task(r).await,
                    Op::Resume => c.resume_task(r).await,
                    Op::Stop => c.stop_task(r).await,
                }
            })
            .await?;
        output::json(&with_counts(&res)?)
    }
}

/// The result in protobuf JSON, except that `affected` and `failed` are always present
/// (as int64 strings, `"0"` included): the command exists to print those two counts.
/// Errors: `internal` if the message cannot be encoded.
pub fn with_counts(res: &pb::TaskActionResult) -> Result<serde_json::Value, crate::types::Failure> {
    let mut v = serde_json::to_value(res).map_err(|e| {
        crate::types::Failure::internal(format!("encoding JSON: {e}", e = crate::types::chain(&e)))
    })?;
    if let Some(obj) = v.as_object_mut() {
        obj.entry("affected").or_insert_with(|| "0".into());
        obj.entry("failed").or_insert_with(|| "0".into());
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_always_printed() {
        let v = with_counts(&pb::TaskActionResult::default()).unwrap();
        assert_eq!(v, serde_json::json!({"affected": "0", "failed": "0"}));
        let r = pb::TaskActionResult {
            affected: 3,
            failed: 1,
            errors: vec!["node-a.1: not_found: gone".into()],
        };
        let v = with_counts(&r).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"affected": "3", "failed": "1", "errors": ["node-a.1: not_found: gone"]})
        );
    }
}
