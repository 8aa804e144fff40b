//! `token create|list|revoke` and `whoami` (docs/cli.md "Projects, principals, permissions and
//! tokens"; docs/concepts.md).

use argh::FromArgs;

use super::{output, values, CtlError, Ctx};
use crate::pb;
use crate::types::names;

#[derive(FromArgs, Debug)]
/// issue, list and revoke tokens
#[argh(subcommand, name = "token", help_triggers("-h", "--help", "help"))]
pub struct TokenArgs {
    #[argh(subcommand)]
    pub cmd: TokenCmd,
}

#[derive(FromArgs, Debug)]
#[argh(subcommand)]
pub enum TokenCmd {
    Create(CreateArgs),
    List(ListArgs),
    Revoke(RevokeArgs),
}

#[derive(FromArgs, Debug)]
/// issue a token, by default for yourself; the token is shown only this once
#[argh(
    subcommand,
    name = "create",
    help_triggers("-h", "--help", "help"),
    example = "{command_name} trainer -ttl 2592000 -desc gpu-node-07"
)]
pub struct CreateArgs {
    /// principal id (default: yourself)
    #[argh(positional)]
    pub principal: Option<String>,
    /// lifetime in seconds; 0 or left out for the server default
    #[argh(option)]
    pub ttl: Option<String>,
    /// description
    #[argh(option)]
    pub desc: Option<String>,
}

#[derive(FromArgs, Debug)]
/// list tokens (no secrets), by default your own
#[argh(subcommand, name = "list", help_triggers("-h", "--help", "help"))]
pub struct ListArgs {
    /// principal id (default: yourself)
    #[argh(positional)]
    pub principal: Option<String>,
}

#[derive(FromArgs, Debug)]
/// revoke a token; "primary" is the legacy primary token
#[argh(subcommand, name = "revoke", help_triggers("-h", "--help", "help"))]
pub struct RevokeArgs {
    /// principal id
    #[argh(positional)]
    pub principal: String,
    /// token id
    #[argh(positional)]
    pub token_id: String,
}

#[derive(FromArgs, Debug)]
/// print the principal of the current token
#[argh(subcommand, name = "whoami", help_triggers("-h", "--help", "help"))]
pub struct WhoamiArgs {}

fn principal_or_self(p: Option<String>) -> Result<String, CtlError> {
    if let Some(p) = &p {
        names::check_principal_id(p)?;
    }
    Ok(p.unwrap_or_default())
}

impl TokenArgs {
    /// Runs the subcommand; prints `CreateTokenResponse`, `ListTokensResponse` or `{}`.
    /// Errors: `invalid` input; the server's failure.
    pub async fn run(self, ctx: &Ctx) -> Result<(), CtlError> {
        match self.cmd {
            TokenCmd::Create(a) => {
                let principal = principal_or_self(a.principal)?;
                let ttl = a
                    .ttl
                    .as_deref()
                    .map(|t| values::int("ttl", t, 0, i64::MAX))
                    .transpose()?
                    .unwrap_or(0);
                let description = a.desc.unwrap_or_default();
                if description.len() > 1024 || description.chars().any(char::is_control) {
                    return Err(crate::types::Failure::invalid(
                        "-desc: at most 1024 characters, no control characters",
                    )
                    .into());
                }
                let conn = ctx.connect()?;
                let req = pb::CreateTokenRequest {
                    principal,
                    ttl,
                    description,
                };
                output::json(
                    &conn
                        .call(req, |mut c, r| async move { c.create_token(r).await })
                        .await?,
                )
            }
            TokenCmd::List(a) => {
                let req = pb::PrincipalRef {
                    principal: principal_or_self(a.principal)?,
                };
                let conn = ctx.connect()?;
                output::json(
                    &conn
                        .call(req, |mut c, r| async move { c.list_tokens(r).await })
                        .await?,
                )
            }
            TokenCmd::Revoke(a) => {
                names::check_principal_id(&a.principal)?;
                values::plain("token id", &a.token_id)?;
                let conn = ctx.connect()?;
                let req = pb::RevokeTokenRequest {
                    principal: a.principal,
                    token_id: a.token_id,
                };
                output::json(
                    &conn
                        .call(req, |mut c, r| async move { c.revoke_token(r).await })
                        .await?,
                )
            }
        }
    }
}

impl WhoamiArgs {
    /// Prints `WhoAmIResponse`. Errors: the server's failure (`unauthenticated`, ...).
    pub async fn run(self, ctx: &Ctx) -> Result<(), CtlError> {
        let conn = ctx.connect()?;
        output::json(
            &conn
                .call(pb::Empty {}, |mut c, r| async move { c.who_am_i(r).await })
                .await?,
        )
    }
}
