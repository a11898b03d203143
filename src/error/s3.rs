//! Refusals in S3's error form, for routes in front of object stores.
//!
//! S3 SDKs (boto3, the aws CLI, the AWS SDKs, s3cmd) read an error's code
//! and message from S3's XML body, not from `application/problem+json`: a
//! problem reaches them as `(409) Conflict` with the reason lost. On a
//! route with `error_format = "s3"` fencegate's own refusals take S3's
//! form, with codes of its own for what S3 has no name for
//! (`StaleFenceToken`...) and S3's names where one fits (`EntityTooLarge`,
//! `ServiceUnavailable`...). Answers of the upstream pass as they come.

use http::{header, HeaderValue, Response};

use super::{full, ProxyBody, ProxyError};
use crate::token::TokenError;

impl ProxyError {
    /// The `<Code>` of this refusal in S3's form.
    pub fn s3_code(&self) -> &'static str {
        match self {
            Self::Token(TokenError::Missing) => "MissingFenceToken",
            Self::Token(_) => "InvalidFenceToken",
            Self::Stale { .. } => "StaleFenceToken",
            Self::TokenTooFarAhead { .. } => "FenceTokenTooFarAhead",
            Self::NotGranted { .. } => "FenceTokenNotGranted",
            Self::BadTarget(_) => "InvalidURI",
            Self::BadRequest(_) | Self::BadFraming(_) => "InvalidRequest",
            Self::NoRoute => "NoSuchRoute",
            Self::MethodNotAllowed(_) => "MethodNotAllowed",
            Self::UpgradeNotEnabled => "NotImplemented",
            Self::BodyTooLarge { .. } => "EntityTooLarge",
            Self::KeyTooLong { .. } => "KeyTooLongError",
            Self::BodyTimeout => "RequestTimeout",
            Self::StoreUnavailable(_) => "FenceStoreUnavailable",
            Self::StoreLostData(_) => "FenceStoreLostData",
            Self::Recovering { .. } => "FenceRecovering",
            Self::OlderInFlight { .. } => "OlderWriteInFlight",
            Self::ShuttingDown | Self::TooManyTunnels => "ServiceUnavailable",
            Self::UpstreamConnect(_) => "UpstreamUnreachable",
            Self::UpstreamTimeout(_) => "UpstreamTimeout",
            // S3's own 503 for "reduce your request rate", which S3 SDKs
            // retry with backoff.
            Self::UpstreamBusy(_) => "SlowDown",
            Self::Upstream(_) => "UpstreamFailed",
        }
    }

    /// The answer in S3's form: `<Error>` with `Code`, `Message` (the
    /// reason a problem's `detail` gives), `Resource` (the request's path),
    /// `RequestId` (its `X-Request-Id`), and the fence key and highest
    /// token when there are some; the same status and headers as the
    /// problem form.
    ///
    /// `upload_step`: the step of a multipart upload after its creation
    /// (`UploadPart`...) refused. A missing token there gets a message that
    /// begins with the step's name and says that every request of the
    /// upload needs one (tools that add headers to some requests only
    /// leave them out there; s3cmd does not name the request that failed).
    /// SDKs name the operation themselves, so other messages do not.
    pub fn into_s3_response(
        self,
        resource: Option<&str>,
        key: Option<&str>,
        request_id: &str,
        upload_step: Option<&str>,
    ) -> Response<ProxyBody> {
        let mut xml = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error>");
        let mut element = |name: &str, text: &str| {
            xml.push_str(&format!("<{name}>{}</{name}>", escape(text)));
        };
        element("Code", self.s3_code());
        let detail = self.client_detail();
        let message = match upload_step {
            Some(op) if matches!(self, Self::Token(TokenError::Missing)) => format!(
                "{op}: {detail}; every request of a multipart upload needs the token, \
                 not only CreateMultipartUpload (docs/gateway.md has how each S3 tool sends it)"
            ),
            _ => detail,
        };
        element("Message", &message);
        if let Some(r) = resource {
            element("Resource", r);
        }
        element("RequestId", request_id);
        if let Some(k) = key {
            element("FenceKey", k);
        }
        if let Self::Stale { highest, .. } | Self::TokenTooFarAhead { highest, .. } = &self {
            element("HighestToken", &highest.to_string());
        }
        xml.push_str("</Error>");
        let mut resp = Response::new(full(xml));
        *resp.status_mut() = self.status();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/xml"),
        );
        self.finish(resp)
    }
}

/// XML character data: the five characters XML reserves escaped, and any
/// character XML 1.0 does not allow (control characters, U+FFFE, U+FFFF)
/// as U+FFFD, so that every SDK's parser reads the body.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(c),
            '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..='\u{10FFFF}' => {
                out.push(c)
            }
            _ => out.push('\u{FFFD}'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ErrorFormat;
    use http_body_util::BodyExt;

    async fn body(resp: Response<ProxyBody>) -> String {
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn a_stale_write_names_its_code_reason_key_and_highest() {
        let resp = ProxyError::Stale {
            token: 33,
            highest: 34,
        }
        .into_s3_response(
            Some("/reports/q4.csv"),
            Some("s3:/reports/q4.csv"),
            "r-1",
            None,
        );
        assert_eq!(resp.status(), 409);
        assert_eq!(resp.headers()["content-type"], "application/xml");
        assert_eq!(resp.headers()["x-fence-token-highest"], "34");
        assert_eq!(
            body(resp).await,
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>StaleFenceToken</Code>\
             <Message>token 33 is lower than the highest token 34 for this key</Message>\
             <Resource>/reports/q4.csv</Resource><RequestId>r-1</RequestId>\
             <FenceKey>s3:/reports/q4.csv</FenceKey><HighestToken>34</HighestToken></Error>"
        );
    }

    /// s3cmd sends its added headers with CreateMultipartUpload and not
    /// with the parts: the refusal names the request that lacked it.
    #[tokio::test]
    async fn a_missing_token_names_the_request_that_lacked_it() {
        let missing = |step| {
            ProxyError::Token(TokenError::Missing).into_s3_response(
                Some("/b/big.bin"),
                Some("s3:/b/big.bin"),
                "r-3",
                step,
            )
        };
        let part = body(missing(Some("UploadPart"))).await;
        assert!(
            part.contains("<Message>UploadPart: the write carries no X-Fence-Token header; every request of a multipart upload needs the token"),
            "{part}"
        );
        // The aws CLI already says "when calling the PutObject operation".
        let put = body(missing(None)).await;
        assert!(
            put.contains("<Message>the write carries no X-Fence-Token header</Message>"),
            "{put}"
        );
    }

    #[tokio::test]
    async fn text_is_escaped_and_causes_stay_in_the_log() {
        let resp = ProxyError::StoreUnavailable("redis: Connection refused at 10.0.0.7".into())
            .into_s3_response(Some("/b/<a>&'\"\u{1}\u{FFFE}\u{FFFF}"), None, "r-2", None);
        assert_eq!(resp.status(), 503);
        assert_eq!(resp.headers()["retry-after"], "1");
        let text = body(resp).await;
        assert!(
            text.contains(
                "<Resource>/b/&lt;a&gt;&amp;&apos;&quot;\u{FFFD}\u{FFFD}\u{FFFD}</Resource>"
            ),
            "{text}"
        );
        assert!(
            text.contains("<Code>FenceStoreUnavailable</Code>"),
            "{text}"
        );
        assert!(!text.contains("10.0.0.7"), "{text}");
        assert!(!text.contains("<FenceKey>"), "{text}");
    }

    #[test]
    fn each_refusal_has_a_code_and_the_format_parses() {
        for (e, code) in [
            (ProxyError::Token(TokenError::Missing), "MissingFenceToken"),
            (ProxyError::NotGranted { token: 3 }, "FenceTokenNotGranted"),
            (ProxyError::BodyTooLarge { limit: 1 }, "EntityTooLarge"),
            (ProxyError::ShuttingDown, "ServiceUnavailable"),
        ] {
            assert_eq!(e.s3_code(), code);
        }
        assert_eq!("s3".parse::<ErrorFormat>(), Ok(ErrorFormat::S3));
        assert_eq!("problem".parse::<ErrorFormat>(), Ok(ErrorFormat::Problem));
        assert!("xml".parse::<ErrorFormat>().is_err());
    }
}
