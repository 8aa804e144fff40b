//! `principal create|delete`, `grant` and `revoke` (docs/cli.md "Projects, principals, permissions
//! and tokens"; docs/concepts.md).

use argh::FromArgs;

use super::{output, values, CtlError, Ctx};
use crate::pb;
use crate::types::names;

#[derive(FromArgs, Debug)]
/// create and delete principals
#[argh(subcommand, name = "principal", help_triggers("-h", "--help", "help"))]
pub struct PrincipalArgs {
    #[argh(subcommand)]
    pub cmd: PrincipalCmd,
}

#[derive(FromArgs, Debug)]
#[argh(subcommand)]
pub enum PrincipalCmd {
    Create(CreateArgs),
    Delete(DeleteArgs),
}

#[derive(FromArgs, Debug)]
/// create a principal in a project; the token in the output is shown only this once
#[argh(
    subcommand,
    name = "create",
    help_triggers("-h", "--help", "help"),
    example = "{command_name} root/team-a trainer -kind agent"
)]
pub struct CreateArgs {
    /// the project the principal belongs to
    #[argh(positional)]
    pub project: String,
    /// principal id (no '.', '/' or spaces; unique in the cluster)
    #[argh(positional)]
    pub id: String,
    /// agent, user or service (default agent); a label only
    #[argh(option)]
    pub kind: Option<String>,
    /// the first token's lifetime in seconds; 0 for the server default
    #[argh(option)]
    pub ttl: Option<String>,
}

#[derive(FromArgs, Debug)]
/// delete a principal and all its tokens
#[argh(subcommand, name = "delete", help_triggers("-h", "--help", "help"))]
pub struct DeleteArgs {
    /// principal id
    #[argh(positional)]
    pub id: String,
}

#[derive(FromArgs, Debug)]
/// grant permissions on a project (and its subprojects) to a principal
#[argh(
    subcommand,
    name = "grant",
    help_triggers("-h", "--help", "help"),
    example = "{command_name} root/team-a trainer sandbox.create,sandbox.operate"
)]
pub struct GrantArgs {
    /// project path
    #[argh(positional)]
    pub project: String,
    /// principal id
    #[argh(positional)]
    pub principal: String,
    /// permissions, comma separated: sandbox.create, sandbox.operate, layer.use,
    /// layer.publish, project.admin, fleet.view, fleet.operate
    #[argh(positional)]
    pub perms: String,
}

#[derive(FromArgs, Debug)]
/// revoke permissions on a project from a principal; all of them when none are named
#[argh(subcommand, name = "revoke", help_triggers("-h", "--help", "help"))]
pub struct RevokeArgs {
    /// project path
    #[argh(positional)]
    pub project: String,
    /// principal id
    #[argh(positional)]
    pub principal: String,
    /// permissions, comma separated
    #[argh(positional)]
    pub perms: Option<String>,
}

impl PrincipalArgs {
    /// Runs the subcommand; prints `CreatePrincipalResponse` (with the token) or `{}`.
    /// Errors: `invalid` for a bad project, id, kind or ttl; the server's failure.
    pub async fn run(self, ctx: &Ctx) -> Result<(), CtlError> {
        match self.cmd {
            PrincipalCmd::Create(a) => {
                names::check_project_path(&a.project)?;
                names::check_principal_id(&a.id)?;
                let kind = a.kind.unwrap_or_else(|| "agent".into());
                values::one_of("kind", &kind, &values::KINDS)?;
                let ttl = a
                    .ttl
                    .as_deref()
                    .map(|t| values::int("ttl", t, 0, i64::MAX))
                    .transpose()?
                    .unwrap_or(0);
                let conn = ctx.connect()?;
                let req = pb::CreatePrincipalRequest {
                    project: a.project,
                    principal_id: a.id,
                    kind,
                    ttl,
                };
                output::json(
                    &conn
                        .call(req, |mut c, r| async move { c.create_principal(r).await })
                        .await?,
                )
            }
            PrincipalCmd::Delete(a) => {
                names::check_principal_id(&a.id)?;
                let conn = ctx.connect()?;
                let req = pb::PrincipalRef { principal: a.id };
                output::json(
                    &conn
                        .call(req, |mut c, r| async move { c.delete_principal(r).await })
                        .await?,
                )
            }
        }
    }
}

fn grant_request(
    project: String,
    principal: String,
    perms: Option<&str>,
) -> Result<pb::GrantRequest, CtlError> {
    names::check_project_path(&project)?;
    names::check_principal_id(&principal)?;
    let permissions = perms
        .map(values::permissions)
        .transpose()?
        .unwrap_or_default();
    Ok(pb::GrantRequest {
        project,
        principal,
        permissions,
    })
}

impl GrantArgs {
    /// Grants and prints the project. Errors: `invalid` input; the server's failure.
    pub async fn run(self, ctx: &Ctx) -> Result<(), CtlError> {
        let req = grant_request(self.project, self.principal, Some(&self.perms))?;
        let conn = ctx.connect()?;
        output::json(
            &conn
                .call(req, |mut c, r| async move { c.grant(r).await })
                .await?,
        )
    }
}

impl RevokeArgs {
    /// Revokes and prints the project. Errors: `invalid` input; the server's failure.
    pub async fn run(self, ctx: &Ctx) -> Result<(), CtlError> {
        let req = grant_request(self.project, self.principal, self.perms.as_deref())?;
        let conn = ctx.connect()?;
        output::json(
            &conn
                .call(req, |mut c, r| async move { c.revoke(r).await })
                .await?,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grant_requests_are_checked() {
        let r = grant_request(
            "root/team-a".into(),
            "trainer".into(),
            Some("sandbox.create,layer.use"),
        )
        .unwrap();
        assert_eq!(r.permissions, vec!["sandbox.create", "layer.use"]);
        let r = grant_request("root/team-a".into(), "trainer".into(), None).unwrap();
        assert!(r.permissions.is_empty());
        assert!(grant_request("team-a".into(), "trainer".into(), None).is_err());
        assert!(grant_request("root".into(), "a.b".into(), None).is_err());
        assert!(grant_request("root".into(), "t".into(), Some("root.everything")).is_err());
    }
}
