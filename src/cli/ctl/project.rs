//! `project create|get|delete` (docs/cli.md;
//! docs/concepts.md).

use argh::FromArgs;

use super::{output, values, CtlError, Ctx};
use crate::pb;
use crate::types::names;

#[derive(FromArgs, Debug)]
/// create, show and delete projects
#[argh(subcommand, name = "project", help_triggers("-h", "--help", "help"))]
pub struct ProjectArgs {
    #[argh(subcommand)]
    pub cmd: ProjectCmd,
}

#[derive(FromArgs, Debug)]
#[argh(subcommand)]
pub enum ProjectCmd {
    Create(CreateArgs),
    Get(GetArgs),
    Delete(DeleteArgs),
}

#[derive(FromArgs, Debug)]
/// create a subproject; quota keys left out take the tightest ancestor limit
#[argh(
    subcommand,
    name = "create",
    help_triggers("-h", "--help", "help"),
    example = "{command_name} root team-a -quota sandboxes=1000,cpu_cores=4000,memory_mb=4096000"
)]
pub struct CreateArgs {
    /// parent project, e.g. root
    #[argh(positional)]
    pub parent: String,
    /// the new project's name (no / or spaces)
    #[argh(positional)]
    pub name: String,
    /// quota k=v,...: sandboxes, cpu_cores, memory_mb, gpus
    #[argh(option)]
    pub quota: Option<String>,
}

#[derive(FromArgs, Debug)]
/// show a project (default -project): quota, usage, each principal's permissions, subprojects
#[argh(subcommand, name = "get", help_triggers("-h", "--help", "help"))]
pub struct GetArgs {
    /// project path, e.g. root/team-a
    #[argh(positional)]
    pub project: Option<String>,
}

#[derive(FromArgs, Debug)]
/// delete an empty project (no subprojects, usage or principals of its own)
#[argh(subcommand, name = "delete", help_triggers("-h", "--help", "help"))]
pub struct DeleteArgs {
    /// project path
    #[argh(positional)]
    pub project: String,
}

impl ProjectArgs {
    /// Runs the subcommand and prints the project (or `{}` after a delete) as JSON.
    /// Errors: `invalid` for a bad path, name or quota; the server's failure.
    pub async fn run(self, ctx: &Ctx) -> Result<(), CtlError> {
        match self.cmd {
            ProjectCmd::Create(a) => {
                names::check_project_path(&a.parent)?;
                names::check_project_name(&a.name)?;
                let quota = a
                    .quota
                    .as_deref()
                    .map(values::quota)
                    .transpose()?
                    .unwrap_or_default();
                let conn = ctx.connect()?;
                let req = pb::CreateProjectRequest {
                    parent: a.parent,
                    name: a.name,
                    quota,
                };
                output::json(
                    &conn
                        .call(req, |mut c, r| async move { c.create_project(r).await })
                        .await?,
                )
            }
            ProjectCmd::Get(a) => {
                if let Some(p) = &a.project {
                    names::check_project_path(p)?;
                }
                let conn = ctx.connect()?;
                let req = pb::ProjectRef {
                    project: a.project.unwrap_or_else(|| conn.project.clone()),
                };
                output::json(
                    &conn
                        .call(req, |mut c, r| async move { c.get_project(r).await })
                        .await?,
                )
            }
            ProjectCmd::Delete(a) => {
                names::check_project_path(&a.project)?;
                let conn = ctx.connect()?;
                let req = pb::ProjectRef { project: a.project };
                output::json(
                    &conn
                        .call(req, |mut c, r| async move { c.delete_project(r).await })
                        .await?,
                )
            }
        }
    }
}
